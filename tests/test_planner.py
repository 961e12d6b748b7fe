"""CPU tests of the work planner (``cute_kernels/planner.py``) and its cost model.

Every plan a test makes goes through ``plan_checks.check_plan``: exact once-only coverage of
(request, q head, new token, KV page / fresh_kv unit), no phantom, packed and unpacked
token-count rules, split-KV bookkeeping and workspace layout, costs, per-CTA order and
fused-writeback ownership.  The property tests draw random batches from a fresh, recorded
seed (``plan_checks.seeded``; replay with ``PYTEST_SEED=<seed>``) over every q-tile size,
fused writeback on/off, unpacked prefill on/off and several GQA ratios; a few fixed cases
pin the documented behaviour.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from cute_kernels import cost_model as CM
from cute_kernels import worklist as W
from cute_kernels.cost_model import DEFAULT_COST_MODEL, CostModel, choose_tile_m
from cute_kernels.planner import (
    _balance,
    _refine,
    fresh_mask_units,
    fresh_tile_owned,
    fresh_writeback_items,
    kv_units,
    next_pow2,
    pack_plan,
    partial_row,
    plan,
    unpacked_requests,
    worst_case_groups,
    worst_case_items,
)
from plan_checks import (  # noqa: F401  (seeded: a fixture)
    CHEAP_SPLIT_MODEL,
    balance_ok,
    check_plan,
    cta_of_items,
    needed_units,
    plans_equal,
    qsl_of,
    random_batch,
    seeded,
)

P = 64
TILE_MS = (64, 128, 192)
GQA = (1, 3, 7, 8)  # G == Gp (1, 8) and padded groups (3 -> 4, 7 -> 8)


def check_kwargs(kw) -> dict:
    """``check_plan`` arguments for ``plan(**kw)``."""
    return dict(num_kv_heads=kw["num_kv_heads"], group_size=kw["group_size"],
                num_ctas=kw.get("num_ctas", 132), tile_m=kw.get("tile_m", 64),
                page_size=kw.get("page_size", P), fresh_kv=kw.get("fresh_kv", False),
                unpacked=kw.get("unpacked_prefill", False), max_splits=kw.get("max_splits", 16),
                cost_model=kw.get("cost_model"), max_partial_rows=kw.get("max_partial_rows"),
                window=kw.get("window", 0))


def checked(q_lens, seq_lens, **kw):
    """``plan`` of the batch, passed through the checker and the balancing bound."""
    kw = {"num_kv_heads": 2, "group_size": 4, **kw}
    qsl, sl = qsl_of(q_lens), np.asarray(seq_lens, np.int32)
    p = plan(qsl, sl, **kw)
    check_plan(p, qsl, sl, **check_kwargs(kw))
    assert balance_ok(p), (p.cta_cost.max(), p.cta_cost.mean(), p.item_cost.max())
    return p


def col(p, name):
    return p.work[:, getattr(W, name)]


# ---------------------------------------------------------------- the checker can fail
def _with_items(p, keep, extra=None):
    """``p`` with the items ``keep`` (indices, repeats allowed) plus ``extra`` rows (on CTA
    0), its offsets and CTA costs made consistent again, so that only the coverage, phantom
    and split checks can catch the change."""
    cta = cta_of_items(p)[keep]
    work, cost, poff = p.work[keep], p.item_cost[keep], p.partial_offsets[keep]
    if extra is not None:
        work = np.concatenate([work, extra])
        cost = np.concatenate([cost, np.ones(len(extra))])
        poff = np.concatenate([poff, np.full(len(extra), -1, np.int32)])
        cta = np.concatenate([cta, np.zeros(len(extra), np.int64)])
    order = np.argsort(cta, kind="stable")
    off = np.concatenate([[0], np.cumsum(np.bincount(cta, minlength=p.num_ctas))])
    return dataclasses.replace(
        p, work=np.ascontiguousarray(work[order]), item_cost=cost[order],
        partial_offsets=np.ascontiguousarray(poff[order]).astype(np.int32),
        cta_offsets=off.astype(np.int32),
        cta_cost=np.bincount(cta[order], weights=cost[order], minlength=p.num_ctas))


def _set(p, i, name, value):
    w = p.work.copy()
    w[i, getattr(W, name)] = value
    return dataclasses.replace(p, work=w)


def _packed_corruptions(p):
    w = p.work
    n = p.n_items
    b, t0, s, ns = (col(p, c) for c in ("REQ", "QSTART", "SPLIT", "NSPLIT"))
    u0, u1 = col(p, "P0"), col(p, "P1")
    unsplit = int(np.flatnonzero((ns == 1) & (u1 - u0 >= 2))[0])
    split = int(np.flatnonzero(ns > 1)[0])
    yield "drop item", "coverage mismatch", _with_items(p, np.arange(n) != unsplit)
    yield "duplicate item", "coverage mismatch", _with_items(
        p, np.concatenate([np.arange(n), [unsplit]]))
    ghost = np.zeros((1, W.WORK_COLS), np.int32)
    ghost[0, [W.REQ, W.QLEN, W.P1, W.NSPLIT, W.QHEAD]] = [3, 1, 1, 1, -1]  # 0 new tokens
    yield "phantom request", "phantom request", _with_items(p, np.arange(n), ghost)
    # request 1: 40 new tokens at positions 260..299 (P = 16): its first q tile (16 tokens)
    # reads pages 0..17 of the sequence's 19
    last = int(np.flatnonzero((b == 1) & (t0 == 0) & (s == ns - 1))[0])
    yield "causally masked page", "causally masked", _set(p, last, "P1", u1[last] + 1)
    yield "page past the sequence", "past the sequence", _set(p, unsplit, "P1", 300 // 16 + 2)
    yield "missing last page", "coverage mismatch", _set(p, unsplit, "P1", u1[unsplit] - 1)
    yield "token count", "bad tokens", _set(p, unsplit, "QLEN", col(p, "QLEN")[unsplit] - 1)
    yield "split index", "split indices", _set(p, split, "SPLIT", (s[split] + 1) % ns[split])
    yield "split count", "mixed", _set(p, split, "NSPLIT", ns[split] + 1)
    yield "wrong head", "coverage mismatch", _set(p, unsplit, "HEAD", 1 - col(p, "HEAD")[unsplit])
    yield "q head", "unpacked item in a packed-only plan", _set(p, unsplit, "QHEAD", 0)
    po = p.partial_offsets.copy()
    po[split] += 1
    yield "partial offset", "partial offsets", dataclasses.replace(p, partial_offsets=po)
    yield "partial rows", "partial_rows", dataclasses.replace(p, partial_rows=p.partial_rows + 1)
    comb = p.combine.copy()
    comb[0, W.C_BASE] += 1
    yield "combine base", "combine list", dataclasses.replace(p, combine=comb)
    off = p.cta_offsets.copy()
    off[1] += 1
    yield "offsets", "cta cost", dataclasses.replace(p, cta_offsets=off)
    cc = p.cta_cost.copy()
    cc[0] += 1.0
    yield "cta cost", "cta cost", dataclasses.replace(p, cta_cost=cc)
    ic = p.item_cost.copy()
    ic[unsplit] *= 1.5
    yield "item cost", "item cost", dataclasses.replace(p, item_cost=ic)
    yield "modeled", "modeled_us", dataclasses.replace(p, modeled_us=p.modeled_us + 1.0)
    c = int(np.flatnonzero(np.diff(p.cta_offsets) >= 2)[0])  # a CTA with two items
    i = int(p.cta_offsets[c])
    swap = np.arange(n)
    swap[[i, i + 1]] = swap[[i + 1, i]]
    yield "order", "order", dataclasses.replace(
        p, work=np.ascontiguousarray(w[swap]), item_cost=p.item_cost[swap],
        partial_offsets=p.partial_offsets[swap])


def _unpacked_corruptions(p):
    n = p.n_items
    qh, s, ns = col(p, "QHEAD"), col(p, "SPLIT"), col(p, "NSPLIT")
    u0, u1 = col(p, "P0"), col(p, "P1")
    unp = int(np.flatnonzero((qh >= 0) & (ns == 1))[0])
    sp = int(np.flatnonzero((qh >= 0) & (ns > 1))[0])
    yield "q head duplicated", "coverage mismatch", _set(p, unp, "QHEAD", (qh[unp] + 1) % 7)
    yield "q head >= G", "bad q head", _set(p, unp, "QHEAD", 7)
    yield "unpacked item as packed", "bad tokens", _set(p, unp, "QHEAD", -1)
    yield "unpacked token count", "bad tokens", _set(p, unp, "QLEN", col(p, "QLEN")[unp] - 1)
    yield "drop item", "coverage mismatch", _with_items(p, np.arange(n) != unp)
    yield "fresh unit past the tile", "past the sequence", _set(p, unp, "P1", u1[unp] + 1)
    po = p.partial_offsets.copy()
    po[sp] += 1  # onto the next q head's rows
    yield "unpacked partial offset", "partial offsets", dataclasses.replace(p, partial_offsets=po)
    # q head 1 of a 2-way split tile: move its split point by one page (each head is still
    # covered exactly once, but the G heads' splits share one workspace group)
    key = (col(p, "REQ") == col(p, "REQ")[sp]) & (col(p, "QSTART") == col(p, "QSTART")[sp])
    h1 = np.flatnonzero(key & (qh == 1))
    w = p.work.copy()
    w[h1[s[h1] == 0], W.P1] += 1
    w[h1[s[h1] == 1], W.P0] += 1
    yield "q heads split differently", "split differently", dataclasses.replace(p, work=w)
    comb = p.combine.copy()
    comb[0, W.C_BASE] += 8
    yield "chunk base", "combine list", dataclasses.replace(p, combine=comb)


@pytest.mark.parametrize("kind", ["packed", "unpacked"])
def test_checker_rejects_corrupted_plans(kind):
    if kind == "packed":
        q_lens, seq_lens = [1, 40, 3, 0], [5000, 300, 3, 100]
        kw = dict(num_kv_heads=2, group_size=4, page_size=16, num_ctas=24,
                  cost_model=CHEAP_SPLIT_MODEL)
        corruptions = _packed_corruptions
    else:  # unpacked, fused writeback, 128-row tiles, split unpacked items
        q_lens, seq_lens = [1, 1024], [700, 4096]
        kw = dict(num_kv_heads=1, group_size=7, num_ctas=40, tile_m=128, fresh_kv=True,
                  unpacked_prefill=True)
        corruptions = _unpacked_corruptions
    p = checked(q_lens, seq_lens, **kw)  # the good plan passes
    assert p.num_splits_max > 1 and (col(p, "NSPLIT") == 1).any()
    ck = check_kwargs({"num_kv_heads": 2, "group_size": 4, **kw})
    names = []
    for name, reason, bad in corruptions(p):
        with pytest.raises(AssertionError) as exc:
            check_plan(bad, qsl_of(q_lens), seq_lens, **ck)
        assert reason in str(exc.value), (name, str(exc.value))
        names.append(name)
    assert len(names) == len(set(names)) >= 9
    with pytest.raises(AssertionError, match="plan flags"):
        check_plan(p, qsl_of(q_lens), seq_lens, **{**ck, "fresh_kv": not ck["fresh_kv"]})


def test_needed_units_small_cases():
    # 2 new tokens, L = 5, P = 2: positions 3 and 4 read pages {0, 1} and {0, 1, 2}
    assert needed_units(2, 5, 2, False).tolist() == [[True, True, False], [True, True, True]]
    # fused units: ctx 3 -> old pages 0, 1 (keys 0-1, 2), fresh tile 2 holds keys 3-4
    assert needed_units(2, 5, 2, True).tolist() == [[True, True, True], [True, True, True]]
    # 3 new tokens after 1 cached (P = 2): old page 0, fresh tiles 1 (tokens 0-1), 2 (token 2)
    assert needed_units(3, 4, 2, True).tolist() == [[True, True, False], [True, True, False],
                                                    [True, True, True]]


# ------------------------------------------------------------------ random properties
@pytest.mark.parametrize("group_size", GQA)
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
@pytest.mark.parametrize("fresh_kv", [False, True], ids=["pages", "fresh"])
@pytest.mark.parametrize("tile_m", TILE_MS)
def test_random_plans_are_exact(seeded, tile_m, fresh_kv, unpacked, group_size):
    """Exact coverage, unpacked rule, determinism, balance, capacity bounds and split
    limits on random mixed batches (page size 64, some at 16), under the default cost model
    and under one that makes splitting cheap."""
    rng = seeded.rng()
    n_split = n_unpacked = 0
    for it in range(8):
        page = int(rng.choice([P, P, 16]))
        q_lens, seq_lens = random_batch(rng, tile_m, page=page)
        if it == 0:  # decodes only, one of them long: the cheap split model splits it
            q_lens, seq_lens = [1, 1], [int(rng.integers(1, 300))]
            seq_lens.insert(int(rng.integers(0, 2)), int(rng.integers(1500, 4000)))
        elif it % 2 == 0:  # a long decode row: split-KV
            q_lens.append(1)
            seq_lens.append(int(rng.integers(1500, 4000)))
        if it % 3 == 0:  # a chunk over a context: unpacked where G < Gp
            k = int(rng.integers(2, 4))
            q_lens.append(k * tile_m)
            seq_lens.append(k * tile_m + int(rng.integers(300, 1200)))
        qsl, sl = qsl_of(q_lens), np.asarray(seq_lens, np.int32)
        for cheap in (False, True):
            kw = dict(num_kv_heads=int(rng.integers(1, 3)), group_size=group_size,
                      page_size=page, tile_m=tile_m, fresh_kv=fresh_kv,
                      unpacked_prefill=unpacked)
            if cheap:
                kw.update(cost_model=CHEAP_SPLIT_MODEL, num_ctas=int(rng.choice([8, 16, 40])),
                          max_splits=int(rng.integers(2, 17)),
                          max_partial_rows=[None, int(rng.integers(0, 3000))][it % 2])
            else:
                kw.update(num_ctas=int(rng.choice([1, 7, 132, 264])),
                          allow_split=bool(rng.random() < 0.85),
                          max_splits=int(rng.integers(1, 17)))
            with seeded.case(it=it, q_lens=q_lens, seq_lens=seq_lens, kw=kw):
                p = plan(qsl, sl, **kw)
                unp = check_plan(p, qsl, sl, **check_kwargs(kw))
                rule = (unpacked_requests(qsl, sl, group_size=group_size, page_size=page,
                                          tile_m=tile_m, cost_model=kw.get("cost_model"),
                                          fresh_kv=fresh_kv)
                        if unpacked else np.zeros(len(q_lens), bool))
                assert unp == set(np.flatnonzero(rule).tolist()), "unpacked rule"
                assert all(q_lens[r] >= tile_m for r in unp), "short rows stay packed"
                assert balance_ok(p), (p.cta_cost.max(), p.cta_cost.mean(), p.item_cost.max())
                assert plans_equal(p, plan(qsl.astype(np.int64), list(seq_lens), **kw)), \
                    "not deterministic across input containers"
                if not kw.get("allow_split", True) or kw["max_splits"] == 1:
                    assert p.num_splits_max == 1
                lim = (len(q_lens), max(1, sum(q_lens)), max(1, max(seq_lens)),
                       kw["num_kv_heads"], group_size)
                assert p.n_items <= worst_case_items(
                    *lim, page_size=page, tile_m=tile_m, max_splits=kw["max_splits"],
                    fresh_kv=fresh_kv, unpacked_prefill=unpacked), "worst_case_items"
                assert p.combine.shape[0] <= worst_case_groups(*lim, page_size=page), \
                    "worst_case_groups"
            n_split += cheap and p.num_splits_max > 1
            n_unpacked += len(unp)
    with seeded.case():
        assert n_split > 0, "the batches never split"
        assert (n_unpacked > 0) == (unpacked and group_size < next_pow2(group_size))


@pytest.mark.parametrize("tile_m", TILE_MS)
def test_split_never_models_worse_than_no_split(seeded, tile_m):
    rng = seeded.rng()
    for _ in range(40):
        nb = int(rng.integers(1, 12))
        q = rng.integers(0, 3 * tile_m, nb) * (rng.random(nb) < 0.3) + (rng.random(nb) < 0.7)
        sl = q + rng.integers(0, 20000, nb)
        kw = dict(num_kv_heads=int(rng.integers(1, 9)), group_size=int(rng.integers(1, 9)),
                  tile_m=tile_m, fresh_kv=bool(rng.integers(0, 2)),
                  unpacked_prefill=bool(rng.integers(0, 2)))
        with seeded.case(q=q.tolist(), sl=sl.tolist(), kw=kw):
            a = plan(qsl_of(q), sl, **kw)
            b = plan(qsl_of(q), sl, allow_split=False, **kw)
            assert a.modeled_us <= b.modeled_us + 1e-9


def test_random_large_batches_balance(seeded):
    rng = seeded.rng()
    for _ in range(25):
        nb = int(rng.integers(1, 300))
        decode = rng.random(nb) < 0.8
        q = np.where(decode, 1, rng.integers(0, 2048, nb))
        sl = q + rng.integers(0, 65536, nb) * (rng.random(nb) < 0.9)
        kw = dict(num_kv_heads=int(rng.choice([1, 2, 4, 8])),
                  group_size=int(rng.choice([1, 4, 7, 8, 12, 16])),
                  num_ctas=int(rng.choice([66, 132, 264])), tile_m=int(rng.choice(TILE_MS)),
                  fresh_kv=bool(rng.integers(0, 2)), unpacked_prefill=bool(rng.integers(0, 2)))
        with seeded.case(nb=nb, kw=kw):
            p = plan(qsl_of(q), sl, **kw)
            assert balance_ok(p), (p.cta_cost.max(), p.cta_cost.mean(), p.item_cost.max())
            if p.n_items:  # the makespan is never below the mean or the largest item
                assert p.cta_cost.max() >= max(p.cta_cost.mean(), p.item_cost.max()) - 1e-9


# ------------------------------------------------------------------------ edge cases
@pytest.mark.parametrize("fresh_kv,unpacked", [(False, False), (True, True)])
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_empty_batch(num_ctas, fresh_kv, unpacked):
    for q_lens, seq_lens in [([], []), ([0, 0, 0], [10, 0, 64]), ([2, 3], [0, 0])]:
        p = checked(q_lens, seq_lens, num_kv_heads=4, group_size=2, num_ctas=num_ctas,
                    fresh_kv=fresh_kv, unpacked_prefill=unpacked)
        assert p.n_items == 0 and p.work.shape == (0, W.WORK_COLS)
        assert p.cta_offsets.shape == (num_ctas + 1,) and not p.cta_offsets.any()
        assert p.partial_rows == 0 and p.num_splits_max == 1
        assert p.combine.shape == (0, W.COMBINE_COLS)
        assert p.modeled_us == 0.0 and not p.cta_cost.any()
        assert (p.fresh_kv, p.unpacked) == (fresh_kv, unpacked)


def test_one_token_rows():
    sl = [1, 63, 64, 65, 127, 128, 129, 5000]
    p = checked([1] * len(sl), sl, num_kv_heads=3, group_size=2, allow_split=False)
    assert (col(p, "QLEN") == 1).all() and (col(p, "QSTART") == 0).all()
    for row in p.work:
        assert row[W.P0] == 0 and row[W.P1] == -(-sl[row[W.REQ]] // P)


def test_zero_new_token_rows_are_skipped():
    p = checked([0, 3, 0, 1, 0], [100, 50, 7, 9, 0], num_kv_heads=2, group_size=1)
    assert set(col(p, "REQ").tolist()) == {1, 3}


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_seq_len_around_page_multiple(page_size, delta):
    for mult in [1, 2, 5]:
        L = mult * page_size + delta
        for ql in sorted({1, 2, min(L, 17), L}):
            p = checked([ql], [L], page_size=page_size, num_kv_heads=1, group_size=1,
                        allow_split=False)
            assert col(p, "P1").max() == -(-L // page_size)
            assert col(p, "P1").min() == (L - ql + min(ql, 64) - 1) // page_size + 1


@pytest.mark.parametrize("group_size", range(1, 9))
def test_group_sizes(group_size):
    gp = next_pow2(group_size)
    assert gp == {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}[group_size]
    tpt = 64 // gp
    q_lens = [1, 5, 37, 100]
    p = checked(q_lens, [1, 300, 40, 100], num_kv_heads=2, group_size=group_size, page_size=16)
    assert col(p, "QLEN").max() <= tpt
    n_tiles = sum(-(-q // tpt) for q in q_lens) * 2
    assert len({(r[W.REQ], r[W.HEAD], r[W.QSTART]) for r in p.work.tolist()}) == n_tiles


def test_prefill_chunk_kv_equals_q_len():
    # fresh prompt: L == q_len; tile j (16 tokens, Gp = 4) ends at position 16j + 15
    p = checked([300], [300], num_kv_heads=1, group_size=4, allow_split=False)
    assert p.n_items == -(-300 // 16)
    for row in p.work:
        assert row[W.P0] == 0 and row[W.P1] == (row[W.QSTART] + row[W.QLEN] - 1) // 64 + 1


def test_odd_page_sizes_and_tiles():
    """The planner's arithmetic does not assume the product's 64-token pages."""
    checked([7, 130, 1], [7, 400, 77], tile_m=128, group_size=3, page_size=3, num_ctas=5)
    checked([7, 130, 1], [7, 400, 77], tile_m=16, group_size=8, page_size=1, num_ctas=5,
            cost_model=CHEAP_SPLIT_MODEL, max_splits=5)
    checked([7, 200, 1], [7, 400, 77], tile_m=192, group_size=7, page_size=5, num_ctas=5,
            cost_model=CHEAP_SPLIT_MODEL, max_splits=5, fresh_kv=True, unpacked_prefill=True)


def test_invalid_inputs():
    kw = dict(num_kv_heads=1, group_size=1)
    for args, err in [(([0, 5], [3]), ValueError),          # seq_len < q_len
                      (([0, 5, 3], [9, 9]), ValueError),    # decreasing qsl
                      (([1, 5], [9]), ValueError),          # qsl[0] != 0
                      (([0, 5], [9, 9]), ValueError),       # length mismatch
                      (([0, 5], [-1]), ValueError),         # negative seq_len
                      ((np.array([0.0, 5.0]), [9]), TypeError)]:
        with pytest.raises(err):
            plan(*args, **kw)
    with pytest.raises(ValueError):
        plan([0, 5], [9], num_kv_heads=1, group_size=16, tile_m=8)  # Gp > tile_m
    with pytest.raises(ValueError):
        plan([0, 5], [9], num_kv_heads=1, group_size=3, tile_m=66)  # not a multiple of Gp
    for bad in ("num_ctas", "num_kv_heads", "max_splits", "page_size"):
        with pytest.raises(ValueError):
            plan([0, 5], [9], **{**kw, bad: 0})
    with pytest.raises(OverflowError):
        plan([0, 1], [2 ** 31], **kw)


# ------------------------------------------------------------------------- split-KV
def test_single_huge_request_splits_to_fill_ctas():
    p = checked([1], [131072], num_kv_heads=8, group_size=4)
    assert p.num_splits_max == 16 and p.n_items == 8 * 16
    assert p.partial_rows == 8 * 16 * 1 * 4  # 8 groups x 16 splits x (1 token x Gp 4) rows
    assert p.combine.shape == (8, W.COMBINE_COLS)
    p1 = checked([1], [131072], num_kv_heads=8, group_size=4, allow_split=False)
    assert p1.num_splits_max == 1 and p1.n_items == 8 and p1.partial_rows == 0
    assert p.modeled_us < p1.modeled_us / 8
    assert (np.diff(p.cta_offsets) <= 1).all()  # items fill distinct CTAs


def test_huge_prefill_single_request():
    p = checked([4096], [65536], num_kv_heads=1, group_size=8, cost_model=CHEAP_SPLIT_MODEL)
    assert p.n_items >= 512


def test_many_tiles_do_not_split():
    # 2048 equal tiles over 132 CTAs: a combine pass would not pay
    p = plan(qsl_of([1] * 256), np.full(256, 32768, np.int32), num_kv_heads=8, group_size=4)
    assert p.num_splits_max == 1 and p.partial_rows == 0 and p.n_items == 2048
    assert balance_ok(p)


def test_max_partial_rows_respected():
    p = checked([1], [131072], num_kv_heads=8, group_size=4, max_partial_rows=100)
    assert 0 < p.partial_rows <= 100
    p0 = checked([1], [131072], num_kv_heads=8, group_size=4, max_partial_rows=0)
    assert p0.num_splits_max == 1


@pytest.mark.parametrize("fresh_kv", [False, True])
def test_unpacked_items_split_over_a_long_context(fresh_kv):
    """A chunk over a long context makes few unpacked tiles of about equal length (8 x 7
    q heads on 40 CTAs): the planner splits only the longest, every q head of a token range
    the same way, and each split range becomes 128 // 8 combine groups (chunks of a 64-row
    packed tile's 8 tokens)."""
    kw = dict(num_kv_heads=1, group_size=7, num_ctas=40, tile_m=128, fresh_kv=fresh_kv,
              unpacked_prefill=True)
    p = checked([1024], [4096], **kw)
    unsplit = checked([1024], [4096], allow_split=False, **kw)
    assert (col(p, "QHEAD") >= 0).all()
    split = col(p, "NSPLIT") > 1
    assert split.any() and not split.all(), "a partial split: only the longest tiles"
    assert p.modeled_us < unsplit.modeled_us * 0.97
    assert p.combine.shape[0] == int(split.sum()) // (7 * 2) * (128 // 8)


@pytest.mark.parametrize("tile_m", [128, 192])
def test_chunk_2048_over_6144_at_28_4_heads_splits_unpacked_items(tile_m):
    """The chunk that was 0.93x FA3 before unpacked items could split (bench v17): some of
    its unpacked tiles split two ways, the plan models >3% faster than unsplit, and its
    workspace fits the backend's (256 rows a CTA of the 64-row grid)."""
    kw = dict(num_kv_heads=4, group_size=7, num_ctas=132, tile_m=tile_m, fresh_kv=True,
              unpacked_prefill=True, max_partial_rows=256 * 264)
    p = checked([2048], [8192], **kw)
    p0 = checked([2048], [8192], allow_split=False, **kw)
    assert p.num_splits_max == 2 and (col(p, "QHEAD") >= 0).all()
    assert p.modeled_us < 0.97 * p0.modeled_us
    assert 0 < p.partial_rows <= 256 * 264


# --------------------------------------------------------------------- unpacked rule
def _brute_tiling_cost(ql, L, tokens, row_mult, cm, tile_m, fresh_kv):
    total = 0.0
    for t0 in range(0, ql, tokens):
        nt = min(tokens, ql - t0)
        if fresh_kv:  # old pages + fresh tiles up to the tile's last token
            pages = -(-(L - ql) // P) + (t0 + nt - 1) // P + 1
        else:
            pages = (L - ql + t0 + nt - 1) // P + 1
        total += float(cm.item_us(pages, nt * row_mult, P, False))
    return total


@pytest.mark.parametrize("fresh_kv", [False, True])
@pytest.mark.parametrize("tile_m", TILE_MS)
def test_unpacked_rule_is_the_cost_comparison(seeded, tile_m, fresh_kv):
    rng = seeded.rng()
    cm = CostModel()
    for _ in range(40):
        g = int(rng.choice([3, 5, 6, 7]))
        gp = next_pow2(g)
        ql = int(rng.integers(1, 4 * tile_m))
        L = ql + int(rng.integers(0, 1500))
        want = ql >= tile_m and (
            g * _brute_tiling_cost(ql, L, tile_m, 1, cm, tile_m, fresh_kv)
            < _brute_tiling_cost(ql, L, tile_m // gp, gp, cm, tile_m, fresh_kv))
        got = unpacked_requests(qsl_of([ql]), np.asarray([L]), group_size=g, tile_m=tile_m,
                                cost_model=cm, fresh_kv=fresh_kv)
        with seeded.case(g=g, ql=ql, L=L):
            assert bool(got[0]) == want


def test_decode_rows_and_full_groups_stay_packed():
    q_lens, seq_lens = [1, 1, 4096, 500], [3000, 70, 4096, 700]
    for g in (1, 2, 4, 8):  # G == Gp: nothing to gain, the plan is the packed one
        p = checked(q_lens, seq_lens, group_size=g, unpacked_prefill=True)
        assert (col(p, "QHEAD") == -1).all() and p.unpacked
        assert np.array_equal(p.work, plan(qsl_of(q_lens), seq_lens, num_kv_heads=2,
                                           group_size=g).work)
    p = checked(q_lens, seq_lens, group_size=7, unpacked_prefill=True)
    qh, b = col(p, "QHEAD"), col(p, "REQ")
    assert (qh[b < 2] == -1).all(), "decode rows are packed"
    assert (qh[b >= 2] >= 0).all(), "long prefill rows are unpacked"
    default = checked([8192, 1, 300], [8192, 900, 400], num_kv_heads=4, group_size=7)
    assert (col(default, "QHEAD") == -1).all() and not default.unpacked


def test_threshold_rule_g7():
    # G = 7 (Gp = 8, 8 tokens a packed tile): 64 new tokens -> 7 unpacked tiles instead of
    # 8 packed; 65 -> 14 instead of 9 stays packed; 63 (< 64) is never unpacked
    qsl = qsl_of([64, 65, 63, 128, 8192])
    sl = np.asarray([64, 65, 63, 128 + 64, 8192], np.int32)
    assert unpacked_requests(qsl, sl, group_size=7).tolist() == [True, False, False, True, True]
    # 28 q / 4 KV heads, prefill 8192: 4 * 7 * 128 unpacked items vs 4 * 1024 packed
    a = plan(qsl_of([8192]), [8192], num_kv_heads=4, group_size=7, unpacked_prefill=True)
    b = plan(qsl_of([8192]), [8192], num_kv_heads=4, group_size=7)
    assert a.n_items == 4 * 7 * 128 and b.n_items == 4 * 1024 and a.num_splits_max == 1
    # 12.5% fewer MMA rows x pages (sum over items of 64 rows x pages read)
    pages = lambda p: int((col(p, "P1") - col(p, "P0")).sum())  # noqa: E731
    assert pages(a) * 8 == pages(b) * 7
    assert a.modeled_us < b.modeled_us


def test_unpacked_item_cost_counts_real_rows_only():
    cm = CostModel()
    p = checked([640], [700], num_kv_heads=1, group_size=3, cost_model=cm,
                unpacked_prefill=True)
    assert sorted(set(col(p, "QHEAD").tolist())) == [0, 1, 2]
    assert (col(p, "NSPLIT") > 1).any()  # 30 items on 132 CTAs: the long tiles split
    w = p.work
    np.testing.assert_allclose(p.item_cost, cm.item_us(w[:, W.P1] - w[:, W.P0], w[:, W.QLEN],
                                                       P, w[:, W.NSPLIT] > 1))


@pytest.mark.parametrize("tile_m", [128, 192])
def test_wide_tiles_cut_the_prefill_items(tile_m):
    one = qsl_of([8192])
    packed = checked([8192], [8192], num_kv_heads=4, group_size=7, tile_m=tile_m)
    m64 = plan(one, [8192], num_kv_heads=4, group_size=7, num_ctas=264)
    tpt = tile_m // 8  # Gp 8: 16 / 24 tokens a packed tile
    assert packed.n_items == 4 * -(-8192 // tpt) and m64.n_items == 4 * 1024
    assert col(packed, "QLEN").max() == tpt
    if tile_m == 128:  # K/V page streams halved: a 16-token tile's halves end in one page
        pages = lambda p: int((col(p, "P1") - col(p, "P0")).sum())  # noqa: E731
        assert 2 * pages(packed) == pages(m64)
    unp = checked([8192], [8192], num_kv_heads=4, group_size=7, tile_m=tile_m,
                  unpacked_prefill=True)
    n = -(-8192 // tile_m)  # 64 or 43 tiles of one q head (192: the last holds 128)
    assert unp.n_items == 28 * n and (col(unp, "QHEAD") >= 0).all()
    assert sorted(set(col(unp, "QLEN").tolist())) == sorted({tile_m, 8192 - (n - 1) * tile_m})
    # causal bound: the tile of tokens t0 .. t0 + tile_m - 1 reads pages 0 .. its last // 64
    assert ((col(unp, "P1") - 1) == (col(unp, "QSTART") + col(unp, "QLEN") - 1) // 64).all()


# ----------------------------------------------------------------- fused writeback
def test_kv_units_formula():
    # ctx = 100 -> 2 old pages; new tokens 0..63 -> fresh tile 0, 64 -> tile 1
    assert kv_units(100, 0) == 3 and kv_units(100, 63) == 3 and kv_units(100, 64) == 4
    assert kv_units(0, 0) == 1 and kv_units(128, 127) == 4
    assert kv_units(np.array([0, 64, 65]), np.array([0, 0, 0])).tolist() == [1, 2, 3]


def test_decode_rows_get_old_pages_plus_one_fresh_tile():
    seq_lens = [1, 2, 64, 65, 128, 129, 1000]
    p = checked([1] * len(seq_lens), seq_lens, num_kv_heads=1, allow_split=False, fresh_kv=True)
    got = {int(r[W.REQ]): int(r[W.P1] - r[W.P0]) for r in p.work}
    assert got == {b: -(-(L - 1) // P) + 1 for b, L in enumerate(seq_lens)}


def test_causal_pruning_of_fresh_tiles():
    # 200 new tokens after 30 cached: 1 old page; q tiles (Gp 1) need fresh tiles 0..t//64
    p = checked([200], [230], num_kv_heads=1, group_size=1, allow_split=False, fresh_kv=True)
    got = sorted((int(r[W.QSTART]), int(r[W.P0]), int(r[W.P1])) for r in p.work)
    assert got == [(0, 0, 2), (64, 0, 3), (128, 0, 4), (192, 0, 5)]
    # the page plan of the same batch reads pages 0..(30 + t) // 64 instead
    q = checked([200], [230], num_kv_heads=1, group_size=1, allow_split=False)
    assert sorted((int(r[W.QSTART]), int(r[W.P1])) for r in q.work) == [
        (0, 2), (64, 3), (128, 4), (192, 4)]


def test_fresh_plan_equals_page_plan_when_ctx_is_page_aligned():
    q_lens, seq_lens = [1, 70, 200, 5], [129, 70 + 128, 200, 64 + 5]
    a = checked(q_lens, seq_lens, fresh_kv=True)
    b = checked(q_lens, seq_lens)
    assert a.fresh_kv and not b.fresh_kv
    assert np.array_equal(a.work, b.work) and np.array_equal(a.cta_offsets, b.cta_offsets)


def test_fresh_tile_owned_is_the_kernel_rule():
    # q_len 150, Gp 4 (16-token tiles): fresh tile 0 -> token 63 -> q tile 48..63; tile 2
    # -> token 149 -> q tile 144..149
    assert fresh_tile_owned(48, 16, 150, 0) and not fresh_tile_owned(32, 16, 150, 0)
    assert fresh_tile_owned(144, 6, 150, 2) and not fresh_tile_owned(128, 16, 150, 2)
    assert fresh_tile_owned(0, 1, 1, 0)  # decode: the single q tile owns the fresh tile
    # unpacked items of one token range: only q head 0 owns (packed items: -1)
    assert [bool(fresh_tile_owned(0, 64, 64, 0, q_head=g)) for g in (-1, 0, 1, 6)] == [
        True, True, False, False]


def simulate_writeback(p, q_lens, seq_lens, block_table, num_blocks, hkv):
    """numpy model of the kernel's fused writeback: ``cache[block, h, row]`` = the token row
    that lands there (-1 untouched).  The owned fresh tile k of (b, h) holds new tokens
    64k .. 64k+63; store 1 goes to page pos // 64 at row offset pos % 64, store 2 (only when
    valid rows reach past that page) to the next page at offset pos % 64 - 64; rows outside
    [0, 64) are clipped (``attention_sm90``'s producer)."""
    qsl = qsl_of(q_lens)
    sl = np.asarray(seq_lens, np.int64)
    cache = np.full((num_blocks, hkv, P), -1, dtype=np.int64)
    writes = np.zeros((num_blocks, hkv, P), dtype=np.int64)
    for _, b, h, k in fresh_writeback_items(p.work, qsl, sl).tolist():
        ctx = int(sl[b]) - int(qsl[b + 1] - qsl[b])
        tok_rows = int(qsl[b]) + 64 * k + np.arange(P)
        pos = ctx + 64 * k
        pg, off = pos // P, pos % P
        stores = [(pg, off)]
        if min(pos + P, int(sl[b])) > (pg + 1) * P:
            stores.append((pg + 1, off - P))
        for page, o in stores:
            assert page < -(-int(sl[b]) // P), "store into a page past the request's last"
            blk = int(block_table[b, page])
            r = o + np.arange(P)
            keep = (r >= 0) & (r < P)
            cache[blk, h, r[keep]] = tok_rows[keep]
            writes[blk, h, r[keep]] += 1
    return cache, writes


def check_writeback(p, q_lens, seq_lens, hkv, rng):
    """The modeled stores of ``p``'s fresh-tile owners, with the lengths the device has
    (``seq_lens``), write every new token once where kv_append would (a random block
    table), no old token, and no block outside the request's pages."""
    qsl = qsl_of(q_lens)
    pages = [-(-L // P) for L in seq_lens]
    nblk = sum(pages) + 3
    perm = rng.permutation(nblk)
    bt = np.full((len(q_lens), max(pages) + 2), nblk - 1, dtype=np.int64)  # garbage tail
    at = 0
    for b, npg in enumerate(pages):
        bt[b, :npg] = perm[at:at + npg]
        at += npg
    cache, writes = simulate_writeback(p, q_lens, seq_lens, bt, nblk, hkv)
    owned = np.zeros(nblk, dtype=bool)
    for b, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        if ql == 0 or L == 0:
            continue
        owned[bt[b, :pages[b]]] = True
        for pos in range(L):
            blk, row = bt[b, pos // P], pos % P
            if pos >= L - ql:
                assert (cache[blk, :, row] == qsl[b] + pos - (L - ql)).all(), (b, pos)
                assert (writes[blk, :, row] == 1).all()
            else:
                assert (writes[blk, :, row] == 0).all(), f"old token {pos} of {b} hit"
    assert writes.max() <= 1, "two stores hit one slot"
    assert not writes[~owned].any(), "a block no request owns was written"


@pytest.mark.parametrize("fresh_kv", [False, True], ids=["pages", "fresh"])
@pytest.mark.parametrize("tile_m", TILE_MS)
def test_sliding_window_plans_skip_every_page_outside_the_window(seeded, tile_m, fresh_kv):
    """Windows below, at and above a page, and longer than the sequences: the checker's
    coverage (every (token, unit) a query sees under the window exactly once) and its
    phantom test (no unit in an item that no token of its tile sees) hold, splits
    included; long rows read only about window / P pages; fused plans still write every
    new token exactly once."""
    rng = seeded.rng()
    for it in range(10):
        window = int(rng.choice([1, 17, 63, 64, 65, 128, 300, 1024, 100000]))
        q_lens, seq_lens = random_batch(rng, tile_m)
        q_lens.append(1)
        seq_lens.append(int(rng.integers(3000, 9000)))  # a long decode row
        if it % 2:
            q_lens.append(2 * tile_m)
            seq_lens.append(2 * tile_m + int(rng.integers(0, 2000)))
        g = int(rng.choice(GQA))
        kw = dict(num_kv_heads=2, group_size=g, tile_m=tile_m, fresh_kv=fresh_kv,
                  window=window, unpacked_prefill=bool(it % 3 == 0),
                  **([dict(cost_model=CHEAP_SPLIT_MODEL, num_ctas=16, max_splits=8)]
                     [0] if it % 2 else {}))
        with seeded.case(it=it, q_lens=q_lens, seq_lens=seq_lens, kw=kw):
            p = checked(q_lens, seq_lens, **kw)
            w = p.work
            long_row = len(q_lens) - (2 if it % 2 else 1)
            pages = (w[:, W.P1] - w[:, W.P0])[w[:, W.REQ] == long_row]
            # per KV head: the pages the window touches (+ the fresh unit when fused)
            assert pages.sum() <= 2 * (-(-window // P) + 2), "window not pruned"
            if fresh_kv:
                check_writeback(p, q_lens, seq_lens, 2, rng)
    with pytest.raises(ValueError, match="window"):
        plan(qsl_of([1]), [5], num_kv_heads=1, group_size=1, window=-1)
    # the checker tells a plan that reads outside the window (or misses a page in it)
    qsl, sl = qsl_of([1, 130]), np.asarray([4000, 900], np.int32)
    for made, told in ((0, 256), (256, 0), (256, 512)):
        kw = dict(num_kv_heads=1, group_size=4, fresh_kv=fresh_kv, tile_m=tile_m)
        p = plan(qsl, sl, window=made, **kw)
        with pytest.raises(AssertionError):
            check_plan(p, qsl, sl, **check_kwargs({**kw, "window": told}))


@pytest.mark.parametrize("tile_m,unpacked", [(64, False), (64, True), (128, True), (192, True)])
def test_writeback_writes_exactly_the_new_tokens(seeded, tile_m, unpacked):
    """Random fused plans (splits forced): the modeled TMA stores of the fresh tiles' owners
    write every new token once, where kv_append would, and nothing else."""
    rng = seeded.rng()
    for it in range(3):
        q_lens, seq_lens = random_batch(rng, tile_m, n_max=8)
        q_lens[0], seq_lens[0] = 3 * tile_m, 3 * tile_m + int(rng.integers(0, 130))
        g = int(rng.choice([1, 3, 7, 8]))
        kw = dict(num_kv_heads=2, group_size=g, num_ctas=int(rng.choice([16, 264])),
                  cost_model=CHEAP_SPLIT_MODEL, max_splits=int(rng.choice([4, 16])),
                  fresh_kv=True, tile_m=tile_m, unpacked_prefill=unpacked)
        with seeded.case(it=it, q_lens=q_lens, seq_lens=seq_lens, kw=kw):
            check_writeback(checked(q_lens, seq_lens, **kw), q_lens, seq_lens, 2, rng)


def test_plans_from_lengths_ahead_of_the_device_store_only_the_new_tokens(seeded):
    """Under async speculative decoding vLLM's host seq_lens (``seq_lens_cpu_upper_bound``,
    drafts assumed accepted) run ahead of the device's, and the backend plans from them: a
    fused plan may then hold a fresh tile past the step's new tokens (masked keys).  Nobody
    may store it: with the device's lengths the owners write each new token once and
    nothing else (it was once TMA-stored into the page after the request's last)."""
    # the case found in review: context 128 (a page multiple) on the device, 130 on the host
    q_lens, dev = [4, 4], [132, 300]
    p = checked(q_lens, [134, 300], num_kv_heads=1, group_size=1, num_ctas=8, fresh_kv=True)
    assert int(p.work[p.work[:, W.REQ] == 0][:, W.P1].max()) == 4  # units 0..3 on the host
    owners = fresh_writeback_items(p.work, qsl_of(q_lens), np.asarray(dev))
    assert sorted(map(tuple, owners[:, 1:].tolist())) == [(0, 0, 0), (1, 0, 0)]
    rng = seeded.rng()
    check_writeback(p, q_lens, dev, 1, rng)
    for it in range(20):
        n = int(rng.integers(1, 9))
        q = 1 + rng.integers(0, 8, n)  # 1 + accepted drafts
        dev = q + rng.choice([0, 1, 60, 63, 64, 65, 127, 128, 500], n)
        host = dev + rng.integers(0, 8, n)
        kw = dict(num_kv_heads=2, group_size=int(rng.choice([1, 4, 7])),
                  num_ctas=int(rng.choice([16, 264])), cost_model=CHEAP_SPLIT_MODEL,
                  fresh_kv=True, tile_m=int(rng.choice(TILE_MS)), unpacked_prefill=True)
        with seeded.case(it=it, q=q.tolist(), dev=dev.tolist(), host=host.tolist(), kw=kw):
            p = checked(q.tolist(), host.tolist(), **kw)
            check_writeback(p, q.tolist(), dev.tolist(), 2, rng)


def test_fresh_mask_units_are_exactly_the_units_with_a_masked_key(seeded):
    """The fused kernel decides once an item which units run the element-wise mask
    (``u == u_part or u >= u_diag``).  Brute force, key by key: a unit holds a masked key
    iff one of its keys is invalid for some query of the tile (queries at pos0 .. seq_len -
    1; an old key is valid iff < ctx, a fresh key iff <= the query and < seq_len)."""
    rng = seeded.rng()
    for _ in range(300):
        ctx = int(rng.choice([0, 1, 63, 64, 65, 127, 128, int(rng.integers(0, 700))]))
        q_len = int(rng.integers(1, 400))
        seq_len = ctx + q_len
        # the tile's first query: any new token, or past the request (an idle 64-row part
        # of a 128/192-row tile starts after the item's tokens)
        pos0 = ctx + int(rng.integers(0, q_len + 80))
        n_old = -(-ctx // P)
        u_part, u_diag = fresh_mask_units(ctx, pos0, seq_len, P)
        q_max = np.minimum(np.arange(pos0, max(pos0 + 1, seq_len)), seq_len - 1)
        for u in range(n_old + -(-q_len // P)):
            if u < n_old:
                masked = bool(((u * P + np.arange(P)) >= ctx).any())
            else:
                keys = ctx + (u - n_old) * P + np.arange(P)
                masked = bool((keys[None, :] > q_max[:, None]).any())
            with seeded.case(ctx=ctx, q_len=q_len, pos0=pos0, u=u):
                assert (u == u_part or u >= u_diag) == masked


# ------------------------------------------------------------------ capacity bounds
@pytest.mark.parametrize("fresh_kv,unpacked", [(False, False), (True, False), (False, True),
                                               (True, True)])
@pytest.mark.parametrize("tile_m", TILE_MS)
def test_worst_case_bounds_random_plans(seeded, tile_m, fresh_kv, unpacked):
    """``worst_case_items`` / ``worst_case_groups`` bound every plan of the limits, also
    with a grid so wide that every tile splits as far as allowed."""
    rng = seeded.rng()
    for trial in range(25):
        lim = dict(max_num_reqs=int(rng.integers(1, 9)),
                   max_num_tokens=int(rng.integers(1, 3 * tile_m + 100)),
                   max_model_len=int(rng.integers(1, 3000)),
                   num_kv_heads=int(rng.integers(1, 4)), group_size=int(rng.integers(1, 9)),
                   page_size=int(rng.choice([16, 64])))
        ms = int(rng.integers(1, 17))
        nb = int(rng.integers(1, lim["max_num_reqs"] + 1))
        cuts = np.sort(rng.integers(0, lim["max_num_tokens"] + 1, nb))
        q = np.diff(np.concatenate([[0], cuts]))
        if rng.random() < 0.4:  # many tiny requests: the most partial tiles
            q = np.minimum(q, 1 + (rng.random(nb) < 0.5))
        sl = np.maximum(np.minimum(q + rng.integers(0, lim["max_model_len"] + 1, nb),
                                   lim["max_model_len"]), q)
        if (sl > lim["max_model_len"]).any():
            continue
        bound = worst_case_items(**lim, tile_m=tile_m, max_splits=ms, fresh_kv=fresh_kv,
                                 unpacked_prefill=unpacked)
        gbound = worst_case_groups(**lim)
        for num_ctas in (132, 100000):
            kw = dict(num_kv_heads=lim["num_kv_heads"], group_size=lim["group_size"],
                      page_size=lim["page_size"], tile_m=tile_m, max_splits=ms,
                      num_ctas=num_ctas, cost_model=CHEAP_SPLIT_MODEL, fresh_kv=fresh_kv,
                      unpacked_prefill=unpacked)
            with seeded.case(trial=trial, lim=lim, q=q.tolist(), sl=sl.tolist(), kw=kw):
                p = plan(qsl_of(q), sl, **kw)
                assert p.n_items <= bound and p.combine.shape[0] <= gbound


def test_worst_case_items_is_attained_and_tight_where_documented():
    # 4 one-token requests at max_model_len, overheads ~0, a huge grid: every tile splits
    # max_splits ways
    p = checked([1] * 4, [4096] * 4, num_kv_heads=2, group_size=4, num_ctas=100000,
                max_splits=8, cost_model=CHEAP_SPLIT_MODEL)
    assert p.n_items == worst_case_items(4, 4, 4096, 2, 4, max_splits=8) == 4 * 2 * 8
    # fresh_kv: 28 cached + 100 new tokens = 2 pages but 3 units for the second q tile,
    # which the bound's +1 unit covers
    p = checked([100], [128], num_kv_heads=1, group_size=1, num_ctas=64,
                cost_model=CHEAP_SPLIT_MODEL, fresh_kv=True)
    assert p.n_items == 2 + 3 and sorted(col(p, "NSPLIT").tolist()) == [2, 2, 3, 3, 3]
    assert worst_case_items(1, 100, 128, 1, 1) < p.n_items <= worst_case_items(
        1, 100, 128, 1, 1, fresh_kv=True)
    # unpacked: 2 requests of 64 tokens at G = 7 make 7 unpacked items each
    p = checked([64, 64], [64, 64], num_kv_heads=1, group_size=7, max_splits=1,
                unpacked_prefill=True)
    assert p.n_items == 14 <= worst_case_items(2, 128, 64, 1, 7, max_splits=1,
                                               unpacked_prefill=True)
    # a G == Gp model needs no extra room
    assert worst_case_items(4, 512, 4096, 2, 8, unpacked_prefill=True) == worst_case_items(
        4, 512, 4096, 2, 8)
    assert worst_case_items(0, 10, 10, 1, 1) == worst_case_items(1, 0, 10, 1, 1) == 0


# -------------------------------------------------------------------------- buffers
def test_pack_plan_round_trip():
    cap = worst_case_items(8, 64, 2000, 2, 4, page_size=16, max_splits=8)
    kw = dict(num_kv_heads=2, group_size=4, page_size=16, num_ctas=20, max_splits=8,
              cost_model=CHEAP_SPLIT_MODEL)
    big = checked([1, 1, 30, 2], [1990, 700, 64, 2], **kw)
    small = checked([1], [17], **kw)
    assert big.num_splits_max > 1 and big.n_items > small.n_items

    def bufs(fill):
        return [np.full((cap, W.WORK_COLS), fill, np.int32), np.full(40, fill, np.int32),
                np.full(cap, fill, np.int32), np.full((cap, W.COMBINE_COLS), fill, np.int32)]

    work, offs, poff, comb = bufs(77)
    n = pack_plan(big, work, offs, poff, comb)
    assert n == big.n_items
    assert np.array_equal(work[:n], big.work) and not work[n:].any()
    assert np.array_equal(offs[:21], big.cta_offsets) and (offs[21:] == n).all()
    assert np.array_equal(poff[:n], big.partial_offsets) and (poff[n:] == -1).all()
    g = big.combine.shape[0]
    assert np.array_equal(comb[:g], big.combine) and not comb[g:].any()
    # an incremental repack gives the bytes of a pack into fresh buffers
    n2 = pack_plan(small, work, offs, poff, comb, prev_n_items=n)
    fresh = bufs(5)
    assert pack_plan(small, *fresh) == n2 == small.n_items
    for a, b in zip([work, offs, poff, comb], fresh):
        assert np.array_equal(a, b)
    flat = np.zeros(cap * W.WORK_COLS, np.int32)  # a flat work buffer
    pack_plan(big, flat, np.zeros(21, np.int32))
    assert np.array_equal(flat.reshape(-1, W.WORK_COLS)[: big.n_items], big.work)
    with pytest.raises(ValueError):
        pack_plan(big, np.zeros((big.n_items - 1, W.WORK_COLS), np.int32), offs)
    with pytest.raises(TypeError):
        pack_plan(big, np.zeros((cap, W.WORK_COLS), np.int64), offs)
    with pytest.raises(ValueError):
        pack_plan(big, work, np.zeros(20, np.int32))
    with pytest.raises(ValueError):
        pack_plan(big, np.zeros((cap, W.WORK_COLS - 1), np.int32), offs)
    with pytest.raises(ValueError):
        pack_plan(big, work, offs, poff, np.zeros((g - 1, W.COMBINE_COLS), np.int32))


def test_pack_plan_into_torch_tensor():
    torch = pytest.importorskip("torch")
    p = checked([3, 1], [100, 2000], page_size=16, num_ctas=20)
    work = torch.full((64, W.WORK_COLS), 9, dtype=torch.int32)
    offs = torch.zeros(21, dtype=torch.int32)
    n = pack_plan(p, work, offs)
    assert np.array_equal(work[:n].numpy(), p.work) and int(work[n:].abs().sum()) == 0
    assert np.array_equal(offs.numpy(), p.cta_offsets)


def test_pack_plan_clears_groups_of_a_plan_with_more_groups_than_items():
    """An unpacked split token range makes one combine group per 64 // Gp tokens, so a plan
    can have more groups than items; packing a small plan over it with ``prev_n_groups``
    gives the bytes of a fresh pack (a stale group would be merged again by the next
    combine launch).  ``DevicePlan.upload`` passes both counts."""
    kw = dict(num_kv_heads=1, group_size=7, num_ctas=132, tile_m=128, unpacked_prefill=True)
    big = checked([1000], [3000], **kw)
    small = checked([1], [70], **kw)
    n_big, g_big = big.n_items, big.combine.shape[0]
    assert g_big > n_big and g_big <= worst_case_groups(1, 1000, 3000, 1, 7)
    cap = 4 * g_big

    def bufs():
        return [np.zeros((cap, W.WORK_COLS), np.int32), np.zeros(133, np.int32),
                np.full(cap, -1, np.int32), np.zeros((cap, W.COMBINE_COLS), np.int32)]

    repacked, fresh, stale = bufs(), bufs(), bufs()
    pack_plan(big, *repacked)
    pack_plan(small, *repacked, prev_n_items=n_big, prev_n_groups=g_big)
    pack_plan(small, *fresh)
    for a, b in zip(repacked, fresh):
        assert np.array_equal(a, b)
    pack_plan(big, *stale)  # without the group count, groups past the items stay stale
    pack_plan(small, *stale, prev_n_items=n_big)
    assert stale[3][n_big:g_big].any()


# ------------------------------------------------------------------- load balancing
def _reference_lpt_makespan(costs, num_ctas):
    import heapq

    heap = [(0.0, c) for c in range(num_ctas)]
    for x in sorted(costs.tolist(), reverse=True):
        load, c = heapq.heappop(heap)
        heapq.heappush(heap, (load + x, c))
    return max(load for load, _ in heap)


def _cost_vector(rng, kind, n):
    if kind == 0:
        return rng.random(n) * 100 + 1
    if kind == 1:
        return np.exp(rng.normal(0, 2, n)) + 0.1
    if kind == 2:
        return np.where(rng.random(n) < 0.05, 500.0, 10 + rng.random(n))
    if kind == 3:
        return 5.0 + rng.integers(0, 3, n)
    if kind == 4:
        return rng.random(n) ** 4 * 1000 + 0.01
    return np.zeros(n) if n % 2 else np.full(n, 3.0)


def test_balance_against_reference_lpt(seeded):
    rng = seeded.rng()
    ratios = []
    for trial in range(90):
        n = int(rng.integers(1, 4000))
        num_ctas = int(rng.choice([1, 7, 66, 132]))
        c = _cost_vector(rng, trial % 6, n)
        with seeded.case(trial=trial, n=n, num_ctas=num_ctas):
            cta, loads = _balance(c, num_ctas)
            assert cta.dtype == np.int64 and cta.min() >= 0 and cta.max() < num_ctas
            np.testing.assert_allclose(np.bincount(cta, weights=c, minlength=num_ctas), loads,
                                       atol=1e-9)
            assert loads.max() <= c.sum() / num_ctas + c.max() + 1e-9  # the proven bound
            c2, l2 = _balance(c.copy(), num_ctas)
            assert np.array_equal(cta, c2) and np.array_equal(loads, l2)  # deterministic
        ref = _reference_lpt_makespan(c, num_ctas)
        if ref > 0:
            ratios.append(loads.max() / ref)
    ratios = np.array(ratios)
    with seeded.case():
        assert ratios.max() <= 1.05 and ratios.mean() <= 1.01, (ratios.max(), ratios.mean())


def test_refine_never_raises_the_makespan_and_keeps_every_item(seeded):
    rng = seeded.rng()
    for trial in range(50):
        n = int(rng.integers(2, 3000))
        num_ctas = int(rng.choice([2, 7, 66, 132]))
        c = (rng.random(n) ** 3) * 100 + 0.5 if trial % 2 else rng.integers(1, 65, n) * 0.9 + 1
        cta, loads = _balance(c, num_ctas)
        r = _refine(c, cta, num_ctas)
        with seeded.case(trial=trial, n=n, num_ctas=num_ctas):
            assert r.shape == cta.shape and r.min() >= 0 and r.max() < num_ctas
            assert not np.shares_memory(r, cta)
            new = np.bincount(r, weights=c, minlength=num_ctas)
            assert np.isclose(new.sum(), c.sum())
            assert new.max() <= loads.max() + 1e-9
            assert np.array_equal(r, _refine(c, cta, num_ctas))  # deterministic


def test_refine_closes_the_prefill_imbalance():
    """One 8192-token prefill, 28/4 heads, 128-row unpacked fused tiles on 132 CTAs: the
    water fill alone leaves the costliest CTA >1% above the mean; the plan (refined) is
    within 0.3% (what exact LPT reaches), with the same items."""
    kw = dict(num_kv_heads=4, group_size=7, num_ctas=132, tile_m=128, unpacked_prefill=True,
              fresh_kv=True)
    p = checked([8192], [8192], **kw)
    assert p.num_splits_max == 1
    # the unrefined schedule: _balance over the items in the planner's generation order,
    # (b, h, q head, tile)
    gen = np.lexsort(tuple(p.work[:, c] for c in (W.QSTART, W.QHEAD, W.HEAD, W.REQ)))
    costs = p.item_cost[gen]
    cta0, loads0 = _balance(costs, 132)
    assert loads0.max() / loads0.mean() > 1.01
    assert p.cta_cost.max() / p.cta_cost.mean() < 1.003
    assert p.modeled_us < loads0.max()
    refined = np.bincount(_refine(costs, cta0, 132), weights=costs, minlength=132)
    np.testing.assert_allclose(refined, p.cta_cost)  # the plan is the refined schedule


# ----------------------------------------------------------------------- cost model
def test_choose_tile_m_follows_the_measured_anchors():
    """128/192-row tiles for prefill-dominated steps only (H200, 28/4 heads, d 128): 192
    where the prefill rows make >= M192_MIN_TILES_PER_CTA tiles of 192 tokens a CTA, 128
    below that; 64 for decode-heavy mixes, decode-only and uniform spec-decode steps."""
    kw = dict(num_q_heads=28, num_kv_heads=4, head_dim=128)
    assert choose_tile_m(qsl_of([8192]), [8192], **kw) == 192   # 43 x 28 = 1204 tiles
    assert choose_tile_m(qsl_of([4096]), [8192], **kw) == 192   # 22 x 28 = 616
    assert choose_tile_m(qsl_of([2048]), [8192], **kw) == 192   # 11 x 28 = 308 >= 297
    assert choose_tile_m(qsl_of([1024]), [8192], **kw) == 128   # 6 x 28 = 168
    assert choose_tile_m(qsl_of([4096]), [8192], **kw, num_ctas=616) == 128  # 1 a CTA
    assert choose_tile_m(qsl_of([1] * 32 + [2048]), [8192] * 32 + [2048], **kw) == 64
    assert choose_tile_m(qsl_of([1] * 32), [8192] * 32, **kw) == 64
    spec = CM.PREFILL_ROW_TOKENS - 1  # uniform spec-decode rows never count as prefill
    assert choose_tile_m(qsl_of([spec] * 8), [30000] * 8, **kw) == 64
    assert choose_tile_m(qsl_of([]), [], **kw) == 64
    # a few short decodes next to a long chunk: still prefill-dominated
    assert choose_tile_m(qsl_of([1, 1, 8192]), [600, 900, 16384], **kw) == 192
    # rows with no new tokens cost nothing
    assert choose_tile_m(qsl_of([0, 0, 8192]), [900000, 900000, 8192], **kw) == 192
    assert CM.M128_MAX_DECODE_FRACTION == 0.25 and CM.M192_MIN_TILES_PER_CTA == 2.25
    # head size 256 has no 192-row kernels: the same prefill-heavy steps take 128 rows
    wide = dict(kw, head_dim=256)
    assert choose_tile_m(qsl_of([8192]), [8192], **wide) == 128
    assert choose_tile_m(qsl_of([1] * 32), [8192] * 32, **wide) == 64


def test_choose_tile_m_thresholds():
    kw = dict(num_q_heads=28, num_kv_heads=4, head_dim=128)
    # 128 vs 64: the decode rows' streaming time against M128_MAX_DECODE_FRACTION of the
    # prefill rows' MMA time
    q, ctx = 4096, 4096
    t_pre = 4.0 * 28 * 128 * (q * ctx + q * (q + 1) // 2) / CM._PREFILL_FLOP_PER_S
    per_tok = 4 * 128 * 2 * 2 / CM._DECODE_BYTES_PER_S
    limit = CM.M128_MAX_DECODE_FRACTION * t_pre / per_tok  # decode KV tokens allowed
    assert choose_tile_m(qsl_of([q, 1]), [q + ctx, int(limit * 0.98)], **kw) == 192
    assert choose_tile_m(qsl_of([q, 1]), [q + ctx, int(limit * 1.02)], **kw) == 64
    # 192 vs 128: ceil(q / 192) x Hq tiles against M192_MIN_TILES_PER_CTA x num_ctas
    tiles = -(-q // 192) * 28  # 616
    at = int(tiles / CM.M192_MIN_TILES_PER_CTA)  # the most CTAs that still get 192
    assert choose_tile_m(qsl_of([q]), [q + ctx], num_ctas=at, **kw) == 192
    assert choose_tile_m(qsl_of([q]), [q + ctx], num_ctas=at + 1, **kw) == 128
    # prefill rows start at PREFILL_ROW_TOKENS new tokens
    assert choose_tile_m(qsl_of([CM.PREFILL_ROW_TOKENS]), [8192], **kw) != 64
    with pytest.raises(ValueError):
        choose_tile_m([0, 4], [4, 5], **kw)


def test_cost_model_formulas():
    cm = DEFAULT_COST_MODEL
    d, bw = cm.head_dim, cm.bytes_per_us
    mem = 2.0 * 64 * d * 2 / bw
    assert cm.page_us(1, 64) == pytest.approx(max(mem, 4.0 * 64 * 64 * d / cm.flops_per_us))
    assert cm.page_us(192, 64) == pytest.approx(max(mem, 4.0 * 192 * 64 * d / cm.flops_per_us))
    store_out = cm.fixed_us(64, False) - cm.item_overhead_us - 64 * d * 2 / bw
    store_part = cm.fixed_us(64, True) - cm.item_overhead_us - 64 * d * 2 / bw
    assert store_out == pytest.approx(64 * d * 2 / bw)
    assert store_part == pytest.approx(cm.split_item_overhead_us + 64 * (d + 1) * 4 / bw)
    assert cm.item_us(5, 64, 64, False) == pytest.approx(
        cm.fixed_us(64, False) + 5 * cm.page_us(64, 64))
    assert cm.combine_us([], [], 132) == 0.0
    nbytes = 2 * 16 * (d + 1) * 4 + 16 * d * 2
    assert cm.combine_us([2], [16], 132) == pytest.approx(
        cm.combine_launch_us + nbytes / (bw * 132))


# ----------------------------------------------------------------------- workspace rows
def test_partial_row_layout():
    # packed: offset + token * Gp + slot
    assert partial_row(100, 3, 4, -1, 2) == 100 + 3 * 4 + 2
    # unpacked, Gp 8 (chunks of 8 tokens), split 1 of 2, 20 tokens, token 17 (chunk 2 of
    # 4 tokens): base + q head + 2 * 2 * 64 + 1 * 4 * 8 + 1 * 8
    assert partial_row(1000 + 3, 17, 8, 3, 0, 1, 2, 20) == 1003 + 256 + 32 + 8


# ----------------------------------------------------------------------------- speed
def test_plan_speed(capsys):
    rng = np.random.default_rng(0)
    cases = {
        "decode 256 req x 8 kv heads, 32k ctx": ([1] * 256, np.full(256, 32768), {}),
        "decode 256 req, random ctx <= 32k": ([1] * 256, rng.integers(1, 32769, 256), {}),
        "mixed 256 req (q <= 64), ctx <= 32k": (list(rng.integers(1, 65, 256)),
                                                rng.integers(64, 32768, 256), {}),
        "single decode 128k ctx (split)": ([1], np.array([131072]), {}),
        "1 decode at 128k + 100 at 1k (split search)": ([1] * 101,
                                                       np.array([131072] + [1024] * 100), {}),
        "prefill 8192, G 7, 192 rows, fused, unpacked": (
            [8192], np.array([8192]), dict(group_size=7, tile_m=192, num_ctas=132,
                                           fresh_kv=True, unpacked_prefill=True)),
        "chunk 2048 over 6144, G 7, 128 rows, fused, unpacked": (
            [2048], np.array([8192]), dict(group_size=7, tile_m=128, num_ctas=132,
                                           fresh_kv=True, unpacked_prefill=True)),
    }
    worst = 0.0
    with capsys.disabled():
        print()
        for name, (q, sl, extra) in cases.items():
            qsl = qsl_of(q)
            sl = np.asarray(np.maximum(sl, q), np.int32)
            kw = {"num_kv_heads": 8, "group_size": 4, **extra}
            plan(qsl, sl, **kw)
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                p = plan(qsl, sl, **kw)
                ts.append(time.perf_counter() - t)
            ms = float(np.median(ts)) * 1e3
            worst = max(worst, ms)
            print(f"[planner timing] {name}: {ms:.3f} ms median, {p.n_items} items, "
                  f"splits<={p.num_splits_max}, makespan {p.cta_cost.max():.1f} us vs mean "
                  f"{p.cta_cost.mean():.1f} us")
    assert worst < 25.0  # generous for shared CI hosts; a few ms on a normal one
