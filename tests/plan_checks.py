"""The planner's plan checker and the seeds of the randomized CPU tests (a helper module,
not a test file: ``from plan_checks import ...``).

``check_plan`` recomputes, independently of the planner, which (request, q head, new
token, KV page) -- or, for ``fresh_kv`` plans, KV unit -- causal attention needs, key
position by key position, and rejects a plan unless it covers each of them exactly once
with no phantom request, page or unit, keeps the token-count rules of packed and unpacked
tiles, the split-KV bookkeeping and workspace layout the kernel and combine pass share,
the cost accounting, the per-CTA item order and (``fresh_kv``) one writer per fresh tile.
Every work-list column is read through its name in ``cute_kernels/worklist.py``.

Seeds: the ``seeded`` fixture wraps ``tests/conftest.py``'s per-test ``seed`` (the session
seed, ``$PYTEST_SEED`` or fresh and shown in the report header, mixed with the node id):
it prints and records it (``user_properties``), gives the test its generator, and
``Seed.case(...)`` prefixes every assertion message with the seed and the command that
replays the failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import numpy as np
import pytest

from cute_kernels import worklist as W
from cute_kernels.cost_model import DEFAULT_COST_MODEL, CostModel
from cute_kernels.options import PAGE_SIZE
from cute_kernels.planner import fresh_writeback_items, next_pow2, partial_row

#: overheads small enough that splitting pays off on the small batches of the tests
CHEAP_SPLIT_MODEL = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                              combine_launch_us=0.0)

# ------------------------------------------------------------------------------- seeds
def session_seed(config=None) -> int:
    """The session seed of ``tests/conftest.py`` (``$PYTEST_SEED`` when set, else drawn
    from the clock once per session and shown in the report header)."""
    plugins = config.pluginmanager.get_plugins() if config is not None else ()
    for plugin in plugins:
        value = getattr(plugin, "SESSION_SEED", None)
        if isinstance(value, int):
            return value
    env = os.environ.get("PYTEST_SEED", "").strip()
    if not env:
        raise RuntimeError("no session seed: run under tests/conftest.py or set PYTEST_SEED")
    return int(env)


@dataclasses.dataclass(frozen=True)
class Seed:
    """A test's seed (conftest's ``seed``: the session seed mixed with the node id) and
    how to replay it."""

    value: int
    session: int
    nodeid: str

    @property
    def replay(self) -> str:
        return (f"seed {self.value}; replay: PYTEST_SEED={self.session} python -m pytest "
                f"-p no:cacheprovider '{self.nodeid}'")

    def rng(self, *salt: int) -> np.random.Generator:
        return np.random.default_rng([self.value, *salt])

    @contextlib.contextmanager
    def case(self, **what):
        """Re-raise an AssertionError with the seed, the replay command and ``what`` in its
        message; any other exception gets them as a note."""
        try:
            yield
        except AssertionError as e:
            raise AssertionError(f"[{self.replay}] [{self._detail(what)}] {e}") from e
        except Exception as e:
            e.add_note(f"[{self.replay}] [{self._detail(what)}]")
            raise

    @staticmethod
    def _detail(what) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in what.items())


@pytest.fixture
def seeded(seed, request) -> Seed:
    """conftest's per-test ``seed`` with its replay command, printed (a failing test's
    captured output shows it) and recorded as the test's user property."""
    s = Seed(int(seed), session_seed(request.config), request.node.nodeid)
    print(s.replay)
    request.node.user_properties.append(("seed", s.value))
    return s


# ----------------------------------------------------------------------------- batches
def qsl_of(q_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))]).astype(np.int32)


def random_batch(rng, tile_m: int = 64, n_max: int = 6, page: int = PAGE_SIZE):
    """Mixed rows: decodes, prefill chunks over a context that is not a page multiple,
    fresh prompts, rows without new tokens (or without KV), lengths around the tile and
    page boundaries, short prefills."""
    q_lens, seq_lens = [], []
    for _ in range(int(rng.integers(1, n_max + 1))):
        kind = int(rng.integers(0, 7))
        if kind == 0:  # decode
            ql, L = 1, int(rng.integers(1, 700))
        elif kind == 1:  # chunk over a context
            ql = int(rng.integers(2, 2 * tile_m + 40))
            L = ql + int(rng.integers(1, 300))
        elif kind == 2:  # fresh prompt
            ql = int(rng.integers(1, 2 * tile_m + 40))
            L = ql
        elif kind == 3:  # no new token, maybe no KV either
            ql, L = 0, int(rng.integers(0, 200)) * int(rng.integers(0, 2))
        elif kind == 4:  # around the tile boundaries
            ql = int(rng.choice([tile_m - 1, tile_m, tile_m + 1, 2 * tile_m + 1]))
            L = ql + int(rng.choice([0, 1, page - 1, page, 100]))
        elif kind == 5:  # around the page boundaries
            L = page * int(rng.integers(1, 5)) + int(rng.integers(-1, 2))
            ql = int(min(L, rng.choice([1, 2, page - 1, page, page + 1])))
        else:  # short prefill / speculative verification
            ql = int(rng.integers(2, 17))
            L = ql + int(rng.integers(0, 400))
        q_lens.append(ql)
        seq_lens.append(L)
    return q_lens, seq_lens


# ---------------------------------------------------------------------- plan utilities
def plans_equal(a, b) -> bool:
    return (np.array_equal(a.work, b.work) and np.array_equal(a.cta_offsets, b.cta_offsets)
            and np.array_equal(a.cta_cost, b.cta_cost)
            and np.array_equal(a.item_cost, b.item_cost)
            and np.array_equal(a.partial_offsets, b.partial_offsets)
            and np.array_equal(a.combine, b.combine) and a.partial_rows == b.partial_rows
            and a.num_splits_max == b.num_splits_max and a.modeled_us == b.modeled_us
            and (a.tile_m, a.fresh_kv, a.unpacked) == (b.tile_m, b.fresh_kv, b.unpacked))


def balance_ok(p, slack: float = 1.0) -> bool:
    """The balancing bound of ``planner._balance``: no CTA above mean + costliest item."""
    if p.n_items == 0:
        return True
    return p.cta_cost.max() <= slack * p.cta_cost.mean() + p.item_cost.max() + 1e-9


def cta_of_items(p) -> np.ndarray:
    return np.repeat(np.arange(p.num_ctas), np.diff(p.cta_offsets))


def unit_of_key(L: int, ctx: int, page: int, fresh_kv: bool) -> np.ndarray:
    """Page (``fresh_kv``: KV unit) of every key position ``0 .. L - 1`` of a request with
    ``ctx`` cached tokens: cache page ``pos // P``; for ``fresh_kv`` the new tokens' keys
    live in fresh tiles ``ceil(ctx / P) + (pos - ctx) // P`` instead."""
    pos = np.arange(L, dtype=np.int64)
    if not fresh_kv:
        return pos // page
    return np.where(pos < ctx, pos // page, -(-ctx // page) + (pos - ctx) // page)


def needed_units(q: int, L: int, page: int, fresh_kv: bool, window: int = 0) -> np.ndarray:
    """``need[t, u]``: new token ``t`` (position ``L - q + t``, causal: keys ``0 ..=`` its
    position; with a ``window``, only keys ``> position - window``) reads some key of
    page / unit ``u``."""
    ctx = L - q
    units = unit_of_key(L, ctx, page, fresh_kv)
    u = np.arange(int(units[-1]) + 1)
    first_key = np.searchsorted(units, u)  # units ascend
    pos = ctx + np.arange(q)[:, None]
    need = first_key[None, :] <= pos
    if window > 0:
        last_key = np.searchsorted(units, u, side="right") - 1
        need &= last_key[None, :] > pos - window
    return need


# ---------------------------------------------------------------------------- checker
def check_plan(p, qsl, seq_lens, *, num_kv_heads: int, group_size: int, num_ctas: int,
               tile_m: int = 64, page_size: int = PAGE_SIZE, fresh_kv: bool = False,
               unpacked: bool = False, max_splits: int | None = None, cost_model=None,
               max_partial_rows: int | None = None, window: int = 0) -> set:
    """Raise AssertionError unless ``p`` is an exact, phantom-free, consistent plan of the
    batch for these options; returns the requests tiled unpacked."""
    cm = DEFAULT_COST_MODEL if cost_model is None else cost_model
    P, G, Hkv = int(page_size), int(group_size), int(num_kv_heads)
    gp = next_pow2(G)
    tpt = tile_m // gp
    qsl = np.asarray(qsl, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    q = np.diff(qsl)
    live = (q > 0) & (sl > 0)
    B = sl.shape[0]

    # ---- containers and flags
    w = p.work
    assert isinstance(w, np.ndarray) and w.dtype == np.int32 and w.ndim == 2, "work dtype"
    assert w.shape[1] == W.WORK_COLS and w.flags.c_contiguous, "work shape"
    n = w.shape[0]
    assert (p.tile_m, p.fresh_kv, p.unpacked) == (tile_m, fresh_kv, unpacked), \
        f"plan flags tile_m/fresh_kv/unpacked {(p.tile_m, p.fresh_kv, p.unpacked)}"
    off = p.cta_offsets
    assert off.dtype == np.int32 and off.shape == (num_ctas + 1,), "bad cta_offsets shape"
    assert off[0] == 0 and off[-1] == n and np.all(np.diff(off) >= 0), "bad cta_offsets"
    assert p.cta_cost.dtype == np.float64 and p.cta_cost.shape == (num_ctas,), "cta_cost shape"
    assert p.item_cost.shape == (n,) and p.partial_offsets.shape == (n,), "per-item shapes"
    assert p.partial_offsets.dtype == np.int32 and p.combine.dtype == np.int32, "dtypes"
    assert p.combine.ndim == 2 and p.combine.shape[1] == W.COMBINE_COLS, "combine shape"
    if max_partial_rows is not None:
        assert p.partial_rows <= max_partial_rows, "max_partial_rows exceeded"

    w64 = w.astype(np.int64)
    b, h, t0, nt = (w64[:, c] for c in (W.REQ, W.HEAD, W.QSTART, W.QLEN))
    u0, u1, s, ns, qh = (w64[:, c] for c in (W.P0, W.P1, W.SPLIT, W.NSPLIT, W.QHEAD))
    poff = p.partial_offsets.astype(np.int64)

    def first(mask, what):
        bad = np.flatnonzero(mask)
        assert bad.size == 0, f"item {int(bad[0])} {w[bad[0]].tolist()}: {what}"

    # ---- items, one by one (vectorized)
    first((b < 0) | (b >= B) | (h < 0) | (h >= Hkv), "bad b/h")
    first(~live[b], "request has no work (phantom request)")
    first((qh < -1) | (qh >= G), "bad q head (col QHEAD)")
    if not unpacked:
        first(qh != -1, "unpacked item in a packed-only plan")
    tokens = np.where(qh < 0, tpt, tile_m)
    first((t0 < 0) | (t0 >= q[b]) | (t0 % tokens != 0)
          | (nt != np.minimum(tokens, q[b] - t0)), "bad tokens for its tile kind")
    first((u0 < 0) | (u0 >= u1), "empty/negative page range")
    ctx = sl[b] - q[b]
    limit = (-(-ctx // P) + (t0 + nt - 1) // P + 1) if fresh_kv else -(-sl[b] // P)
    first(u1 > limit, "page/unit past the sequence (phantom)")
    first((ns < 1) | (s < 0) | (s >= ns), "bad split index")
    if max_splits is not None:
        first(ns > max_splits, "more splits than max_splits")

    # ---- a request is all packed or all unpacked
    kinds: dict[int, set] = {}
    for bb, k in zip(b.tolist(), (qh >= 0).tolist()):
        kinds.setdefault(bb, set()).add(k)
    for bb, k in kinds.items():
        assert len(k) == 1, f"request {bb} mixes packed and unpacked items"
    unp_reqs = {bb for bb, k in kinds.items() if True in k}

    # ---- coverage: every needed (b, q head, token, unit) exactly once, no phantom unit
    need = {bb: needed_units(int(q[bb]), int(sl[bb]), P, fresh_kv, window)
            for bb in np.flatnonzero(live).tolist()}
    groups: dict[tuple, list] = {}
    for i in range(n):
        groups.setdefault((int(b[i]), int(h[i]), int(qh[i])), []).append(i)
    want = {(bb, hh, g) for bb in need for hh in range(Hkv)
            for g in (range(G) if bb in unp_reqs else (-1,))}
    missing = sorted(want - set(groups))
    assert not missing, f"coverage mismatch: no item for (b, h, q head) {missing[0]}"
    assert set(groups) <= want, "coverage mismatch: items of an unexpected q head"
    for (bb, hh, g), items in groups.items():
        nd = need[bb]
        count = np.zeros(nd.shape, dtype=np.int32)
        for i in items:
            a, e, x, y = int(t0[i]), int(t0[i] + nt[i]), int(u0[i]), int(u1[i])
            part = nd[a:e, x:y]
            assert part.shape[1] == y - x and part.any(axis=0).all(), \
                f"item {i} {w[i].tolist()}: causally masked page/unit (phantom)"
            count[a:e, x:y] += part
        bad = np.argwhere(count != nd)
        assert bad.size == 0, (f"coverage mismatch at (b, h, q head slot, token, unit)="
                               f"{(bb, hh, g, *bad[0].tolist())}: count "
                               f"{int(count[tuple(bad[0])])}")

    # ---- split groups (b, h, tile): splits, page ranges, partial offsets
    tiles: dict[tuple, list] = {}
    for i in range(n):
        tiles.setdefault((int(b[i]), int(h[i]), int(t0[i])), []).append(i)
    blocks, expect_combine, split_tiles = [], [], []
    written = []  # (rows, identity (b, h, split, token, slot)) of every split item
    c_tok = 64 // gp
    for key, items in sorted(tiles.items()):
        S, ntok = int(ns[items[0]]), int(nt[items[0]])
        assert all(ns[i] == S and nt[i] == ntok for i in items), f"tile {key}: mixed"
        heads = sorted({int(qh[i]) for i in items})
        assert heads == [-1] or heads == list(range(G)), f"tile {key}: q heads {heads}"
        ranges = None
        for g in heads:
            mine = sorted((int(s[i]), int(u0[i]), int(u1[i])) for i in items if qh[i] == g)
            assert [m[0] for m in mine] == list(range(S)), f"tile {key}: split indices"
            nd = need[key[0]][key[2]:key[2] + ntok]
            start = int(np.argmax(nd.any(axis=0)))  # the tile's first needed page (unit)
            assert mine[0][1] == start and all(mine[k][2] == mine[k + 1][1]
                                               for k in range(S - 1)), \
                f"tile {key}: split ranges not contiguous from its first page {start}"
            r = [m[1:] for m in mine]
            assert ranges is None or r == ranges, f"tile {key}: q heads split differently"
            ranges = r
        if S == 1:
            assert all(poff[i] == -1 for i in items), \
                f"tile {key}: unsplit item with partial offset"
            continue
        unp = heads != [-1]
        lead = [i for i in items if (qh[i] == 0 if unp else s[i] == 0)]
        base = int(poff[lead[0]])
        for i in items:
            exp = base + int(qh[i]) if unp else base + int(s[i]) * ntok * gp
            assert poff[i] == exp, f"tile {key}: partial offsets"
        blocks.append((base, base + S * ntok * gp))
        rows1 = ntok if unp else ntok * gp
        split_tiles += [(S, rows1)] * len(heads)
        if unp:
            for k in range(-(-ntok // c_tok)):
                expect_combine.append((*key[:2], key[2] + k * c_tok,
                                       min(c_tok, ntok - k * c_tok), S, base + k * S * 64))
        else:
            expect_combine.append((*key, ntok, S, base))
        # the rows each split item writes (``planner.partial_row``, the kernel's store)
        # against the layout written out here
        t = np.arange(ntok)
        for i in items:
            si, g = int(s[i]), int(qh[i])
            slots = np.arange(G) if g < 0 else np.array([g])
            tt, ss = np.repeat(t, slots.size), np.tile(slots, ntok)
            rows = np.asarray(partial_row(poff[i], tt, gp, g, ss, si, S, ntok), dtype=np.int64)
            if unp:
                kk = tt // c_tok
                n_k = np.minimum(c_tok, ntok - kk * c_tok)
                exp = base + kk * S * 64 + si * n_k * gp + (tt % c_tok) * gp + g
            else:
                exp = base + si * ntok * gp + tt * gp + ss
            assert np.array_equal(rows, exp), f"item {i}: partial_row differs from the layout"
            ident = np.stack([np.full_like(tt, key[0]), np.full_like(tt, key[1]),
                              np.full_like(tt, si), key[2] + tt, ss], axis=1)
            written.append((rows, ident))
    blocks.sort()
    assert all(blocks[k][1] <= blocks[k + 1][0] for k in range(len(blocks) - 1)), \
        "split workspace blocks overlap"
    assert all(0 <= a and e <= p.partial_rows for a, e in blocks), "block out of the workspace"
    assert sum(e - a for a, e in blocks) == p.partial_rows, "partial_rows"
    assert p.num_splits_max == (int(ns.max()) if n else 1), "num_splits_max"
    got = sorted(map(tuple, p.combine.tolist()))
    assert got == sorted(expect_combine), "combine list"
    assert all(c[W.C_NTOK] >= 1 for c in got), "empty combine group"

    # ---- the combine pass reads exactly the rows the split items wrote, each once
    owner = np.full((max(p.partial_rows, 1), 5), -1, dtype=np.int64)
    for rows, ident in written:
        assert rows.min() >= 0 and rows.max() < p.partial_rows, "partial row out of the workspace"
        assert np.unique(rows).size == rows.size and (owner[rows, 0] == -1).all(), \
            "partial row written twice"
        owner[rows] = ident
    reads = np.zeros(owner.shape[0], dtype=np.int64)
    for cb, ch, tok0, ntok, S, base in got:
        ss, tt, gg = np.meshgrid(np.arange(S), np.arange(ntok), np.arange(G), indexing="ij")
        rows = (base + ss * ntok * gp + tt * gp + gg).ravel()
        assert rows.min() >= 0 and rows.max() < p.partial_rows, "combine reads past the workspace"
        ident = np.stack([np.full(rows.size, cb), np.full(rows.size, ch), ss.ravel(),
                          tok0 + tt.ravel(), gg.ravel()], axis=1)
        assert (owner[rows, 0] >= 0).all(), f"combine group {(cb, ch, tok0)} reads an unwritten row"
        assert np.array_equal(owner[rows], ident), \
            f"combine group {(cb, ch, tok0)} reads another row's partial"
        np.add.at(reads, rows, 1)
    for rows, _ in written:
        assert (reads[rows] == 1).all(), "a written partial row is not combined exactly once"

    # ---- costs
    if n:
        exp = cm.item_us(u1 - u0, np.where(qh < 0, nt * gp, nt), P, ns > 1)
        assert np.allclose(p.item_cost, exp, rtol=1e-12, atol=0), "item cost"
    cta = np.repeat(np.arange(num_ctas), np.diff(off))
    per_cta = np.bincount(cta, weights=p.item_cost, minlength=num_ctas)
    assert np.allclose(p.cta_cost, per_cta, rtol=1e-9, atol=1e-9), "cta cost"
    sp = np.array(split_tiles, dtype=np.int64).reshape(-1, 2)
    modeled = float(p.cta_cost.max(initial=0.0)) + cm.combine_us(sp[:, 0], sp[:, 1], num_ctas)
    assert np.isclose(p.modeled_us, modeled, rtol=1e-9, atol=1e-9), "modeled_us"

    # ---- inside a CTA, items run in (b, h, q head slot, tile, split) order
    keys = np.stack([b, h, qh, t0, s], axis=1)
    for c in range(num_ctas):
        seg = [tuple(r) for r in keys[off[c]:off[c + 1]].tolist()]
        assert seg == sorted(seg), f"CTA {c}: items not in (b, h, q head, tile, split) order"

    # ---- fused writeback: every fresh tile of every (request, KV head) has one writer
    if fresh_kv:
        owners = fresh_writeback_items(w, qsl, sl, P)
        got_o = [tuple(r) for r in owners[:, 1:].tolist()]
        want_o = sorted((bb, hh, k) for bb in need for hh in range(Hkv)
                        for k in range(-(-int(q[bb]) // P)))
        assert sorted(got_o) == want_o and len(set(got_o)) == len(got_o), \
            "fresh tiles without exactly one writer"
        for i, bb, _, k in owners.tolist():
            n_old = -(-int(sl[bb] - q[bb]) // P)
            assert u0[i] <= n_old + k < u1[i], f"item {i}: owner does not read fresh tile {k}"
            last = min(k * P + P - 1, int(q[bb]) - 1)
            assert t0[i] <= last < t0[i] + nt[i], f"item {i}: owner lacks the tile's last token"
            assert qh[i] <= 0, f"item {i}: q head {int(qh[i])} > 0 writes back"
    return unp_reqs
