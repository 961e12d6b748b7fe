"""Phantom-pass work planner for IonAttention (pure numpy, no torch / vLLM imports).

Given the batch layout (``query_start_loc``, ``seq_lens``) the planner enumerates every
(request, KV head, q tile, KV split) item the causal paged-attention kernel has to run,
drops every phantom (requests without new tokens or without KV, pages past the sequence,
pages fully masked by causality for the tile), decides per tile whether to split its KV
range (split-KV, merged by the combine pass), tiles long prefill rows of a padded GQA group
one q head at a time (unpacked tiles, ``unpacked_requests``), and balances the items over
``num_ctas`` persistent CTAs by a cost model (``cost_model.py``).  The work list, the
split-KV workspace layout (``partial_row``) and the combine groups are the contract of
docs/contract.md; the method is docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import worklist as W
from .cost_model import DEFAULT_COST_MODEL, CostModel
from .options import PAGE_SIZE
from .worklist import COMBINE_COLS, WORK_COLS

__all__ = ["Plan", "next_pow2", "unpacked_requests", "kv_units", "partial_row",
    "fresh_tile_owned", "fresh_mask_units", "fresh_writeback_items", "plan",
    "plan_reuse_key", "pack_plan", "worst_case_items", "worst_case_groups"]

# Only a few of the best split candidates (ranked by a lower bound) are scheduled for real.
_MAX_SPLIT_EVALS = 3
# caps that split only the longest tiles in two: quantiles of the tiles over half the
# longest (see the split search in ``plan``)
_PARTIAL_SPLIT_CAPS = 9
# Exact-LPT rounds before the remaining items are water-filled (keeps plan() O(fast)).
_MAX_LPT_ROUNDS = 64
_MAX_FILL_CLASSES = 24
_BIG_FRAC = 1.0 / 16.0  # items above this fraction of the mean load go through exact LPT
# refinement of the chosen assignment (``_refine``): at most _REFINE_ROUNDS move/swap
# rounds, stopping once the costliest CTA is within _REFINE_TOL of max(mean, costliest
# item) or after _REFINE_STALL rounds that leave the maximum where it was
_REFINE_ROUNDS = 64
_REFINE_TOL = 1e-3
_REFINE_STALL = 8


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    x = int(x)
    if x < 1:
        raise ValueError(f"next_pow2 needs x >= 1, got {x}")
    return 1 << (x - 1).bit_length()


def partial_row(partial_offset, token, group_pad: int, q_head=-1, slot=0, split=0,
                n_split=1, ntok=1):
    """Workspace row of a split item's output row (the kernel's ``_store_partial``).  A
    packed item (``q_head < 0``) writes MMA row ``token * Gp + slot`` (slot = q head in the
    group) at ``partial_offset + token * Gp + slot``.  An unpacked item (``q_head >= 0``:
    one q head, one MMA row per token of its ``ntok``; ``partial_offset`` = group base +
    q head) writes token ``t`` of split ``split`` of ``n_split`` in chunk ``k = t // c``
    (``c = 64 // Gp``) at ``partial_offset + k * n_split * 64 + split * n_k * Gp +
    (t % c) * Gp``, ``n_k = min(c, ntok - k * c)`` (module docstring).  Vectorized."""
    gp = int(group_pad)
    c = 64 // gp
    t = np.asarray(token, dtype=np.int64)
    poff = np.asarray(partial_offset, dtype=np.int64)
    packed = poff + t * gp + np.asarray(slot, dtype=np.int64)
    k = t // c
    n_k = np.minimum(c, np.asarray(ntok, dtype=np.int64) - k * c)
    unpacked = (poff + k * np.asarray(n_split, dtype=np.int64) * 64
                + np.asarray(split, dtype=np.int64) * n_k * gp + (t % c) * gp)
    return np.where(np.asarray(q_head) >= 0, unpacked, packed)


def kv_units(ctx, last_new_token, page_size: int = PAGE_SIZE):
    """Fused-writeback (``fresh_kv``) KV units a q tile reads: the ``ceil(ctx / P)`` old
    pages of the cache (positions < ``ctx`` = tokens cached before this step), then the
    fresh tiles 0 ..= ``last_new_token // P`` (fresh tile ``k`` = new tokens
    ``k*P .. k*P+P-1`` of the request, positions ``ctx + k*P ..``), where
    ``last_new_token`` is the tile's last new token relative to the request's first."""
    ctx = np.asarray(ctx, dtype=np.int64)
    last = np.asarray(last_new_token, dtype=np.int64)
    return -(-ctx // page_size) + last // page_size + 1


def window_first(ctx, tok0, window: int, page_size: int = PAGE_SIZE, fresh_kv: bool = False):
    """First KV page (fused writeback: unit) a q tile reads under a sliding ``window``
    (tokens; 0: none, every tile starts at 0).  The tile's first query sits at position
    ``ctx + tok0`` and sees keys from ``ctx + tok0 - window + 1`` on; the page (unit)
    holding that key is the first one with a key any query of the tile sees.  Old page
    ``u`` holds keys ``u*P ..``; fresh unit ``n_old + k`` holds keys ``ctx + k*P ..``.
    Vectorized; a pure function."""
    ctx = np.asarray(ctx, dtype=np.int64)
    tok0 = np.asarray(tok0, dtype=np.int64)
    if window <= 0:
        return np.zeros(np.broadcast(ctx, tok0).shape, dtype=np.int64)
    key0 = np.maximum(ctx + tok0 - window + 1, 0)
    if not fresh_kv:
        return key0 // page_size
    n_old = -(-ctx // page_size)
    return np.where(key0 < ctx, key0 // page_size,
                    n_old + (key0 - ctx) // page_size)


def fresh_mask_units(ctx, pos0, seq_len, page_size: int = PAGE_SIZE):
    """``(u_part, u_diag)``: the KV units of a fused-writeback item whose keys may need
    the element-wise mask (``attention_sm90._mask_unit``, which decides with the same
    arithmetic once an item).  Unit ``u`` of a request with ``ctx`` cached tokens is old
    page ``u`` (keys ``u*P ..``, valid iff ``< ctx``) for ``u < n_old = ceil(ctx / P)``
    and fresh tile ``k = u - n_old`` (keys ``ctx + k*P ..``, valid iff ``<=`` the query's
    position, and ``< seq_len``) otherwise.  For a q tile whose first query sits at
    ``pos0 >= ctx``, unit ``u`` holds a masked key iff ``u == u_part`` (the old page that
    holds ``ctx``; -1 when ``ctx`` is a page multiple) or ``u >= u_diag`` (fresh tiles
    whose last key passes ``min(pos0, seq_len - 1)``).  Vectorized; a pure function."""
    ctx = np.asarray(ctx, dtype=np.int64)
    pos0 = np.asarray(pos0, dtype=np.int64)
    seq_len = np.asarray(seq_len, dtype=np.int64)
    n_old = (ctx + page_size - 1) // page_size
    u_part = np.where(n_old * page_size != ctx, n_old - 1, -1)
    u_diag = n_old + (np.minimum(pos0, seq_len - 1) - ctx + 1) // page_size
    return u_part, u_diag


def fresh_tile_owned(q_start, q_cnt, q_len, k, page_size: int = PAGE_SIZE, q_head=None):
    """Writeback ownership rule of the fused kernel (``attention_sm90`` uses the same test):
    fresh tile ``k`` of (request, KV head) is written to the cache by the item whose q tile
    (new tokens ``q_start .. q_start + q_cnt - 1``) holds new token
    ``min(k*P + P - 1, q_len - 1)`` and whose unit range holds unit ``n_old + k``.  Every
    q tile holding that token needs tile ``k``, and split-KV gives each unit of a q tile
    to exactly one split, so each fresh tile has exactly one owner.  ``q_head`` (work col
    8, optional): unpacked items (``q_head >= 0``) of the G q heads of one KV head all hold
    that token, so only ``q_head == 0`` owns (packed items have -1).  Vectorized; the unit
    range test is the caller's (the kernel asks only for units it processes)."""
    k = np.asarray(k, dtype=np.int64)
    q_len = np.asarray(q_len, dtype=np.int64)
    t = np.minimum(k * page_size + page_size - 1, q_len - 1)
    q_start = np.asarray(q_start, dtype=np.int64)
    own = (t >= q_start) & (t < q_start + np.asarray(q_cnt, dtype=np.int64))
    own = own & (k * page_size < q_len)  # no tile past the new tokens (see the kernel)
    if q_head is not None:
        own = own & (np.asarray(q_head, dtype=np.int64) <= 0)
    return own


def fresh_writeback_items(work, query_start_loc, seq_lens, page_size: int = PAGE_SIZE) -> np.ndarray:
    """``int64 [m, 4]`` rows (item, request, KV head, fresh tile k): every fresh tile that
    item of a ``fresh_kv`` work list writes back to the cache, in item order."""
    w = np.asarray(work, dtype=np.int64).reshape(-1, WORK_COLS)
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    b = w[:, W.REQ]
    q_len = qsl[b + 1] - qsl[b]
    n_old = -(-(sl[b] - q_len) // page_size)
    k0 = np.maximum(w[:, W.P0] - n_old, 0)
    k1 = np.maximum(w[:, W.P1] - n_old, 0)
    cnt = np.where(w[:, W.QLEN] > 0, k1 - k0, 0)  # all-zero padding rows own nothing
    item = np.repeat(np.arange(w.shape[0], dtype=np.int64), cnt)
    k = np.arange(item.shape[0], dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt) + k0[item]
    own = fresh_tile_owned(w[item, W.QSTART], w[item, W.QLEN], q_len[item], k, page_size,
                           w[item, W.QHEAD])
    return np.stack([item[own], b[item][own], w[item, W.HEAD][own], k[own]],
                    axis=1).reshape(-1, 4)


def _tiling_cost(q_len, seq_len, tpt: int, row_mult: int, page_size: int, cm, fresh_kv: bool):
    """Modeled unsplit cost (us) per request of tiling its new tokens into tiles of ``tpt``
    tokens with ``row_mult`` MMA rows per token (one KV head, one q head slot)."""
    nt = -(-q_len // tpt)
    req = np.repeat(np.arange(q_len.shape[0], dtype=np.int64), nt)
    t0 = (np.arange(req.shape[0], dtype=np.int64) - np.repeat(np.cumsum(nt) - nt, nt)) * tpt
    ql = q_len[req]
    ntok = np.minimum(tpt, ql - t0)
    if fresh_kv:
        pages = kv_units(seq_len[req] - ql, t0 + ntok - 1, page_size)
    else:
        pages = (seq_len[req] - ql + t0 + ntok - 1) // page_size + 1
    cost = cm.item_us(pages, ntok * row_mult, page_size, False)
    return np.bincount(req, weights=cost, minlength=q_len.shape[0])


def unpacked_requests(query_start_loc, seq_lens, *, group_size: int, page_size: int = PAGE_SIZE,
                      tile_m: int = 64, cost_model: "CostModel | None" = None,
                      fresh_kv: bool = False) -> np.ndarray:
    """bool per request: tiled one q head x ``tile_m`` tokens (unpacked) under
    ``plan(..., unpacked_prefill=True)``.  True iff the request has work, ``G < Gp``,
    ``q_len >= tile_m`` and ``G`` unpacked tilings (``ceil(q / tile_m)`` tiles each, never
    split) cost less in the cost model than the packed tiling (``ceil(q / (tile_m // Gp))``
    tiles of Gp rows per token), per KV head, both unsplit."""
    cm = DEFAULT_COST_MODEL if cost_model is None else cost_model
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    q_len = np.diff(qsl)
    gp = next_pow2(group_size)
    out = np.zeros(sl.shape[0], dtype=bool)
    if group_size >= gp:
        return out
    cand = np.flatnonzero((q_len >= tile_m) & (sl > 0) & (sl >= q_len))
    if cand.size == 0:
        return out
    ql, L = q_len[cand], sl[cand]
    packed = _tiling_cost(ql, L, tile_m // gp, gp, page_size, cm, fresh_kv)
    unpacked = group_size * _tiling_cost(ql, L, tile_m, 1, page_size, cm, fresh_kv)
    out[cand] = unpacked < packed
    return out




@dataclass(frozen=True)
class Plan:
    work: np.ndarray  # int32 [n_items, WORK_COLS], columns: worklist.py
    cta_offsets: np.ndarray  # int32 [num_ctas + 1]
    num_splits_max: int  # max col 7 (1 = no split anywhere)
    partial_rows: int  # fp32 partial rows needed (0 when no split)
    cta_cost: np.ndarray  # float64 [num_ctas], modeled us per CTA (main pass)
    item_cost: np.ndarray  # float64 [n_items], modeled us per item (row-aligned with work)
    partial_offsets: np.ndarray  # int32 [n_items], first partial row of a split item, -1 if unsplit
    combine: np.ndarray  # int32 [n_groups, COMBINE_COLS]: split groups (worklist.py)
    modeled_us: float  # max(cta_cost) + combine pass (if any split)
    # True: P0/P1 index KV *units* (old pages, then fresh tiles) for the fused-writeback
    # kernel (docs/contract.md); False: cache pages.
    fresh_kv: bool = False
    # True: made with unpacked_prefill=True (QHEAD may hold q heads >= 0)
    unpacked: bool = False
    # MMA rows of a q tile (64, 128 or 192: KernelOptions.tile_m); packed tiles hold
    # tile_m // Gp tokens, unpacked tiles tile_m tokens
    tile_m: int = 64
    # the sliding window (tokens) the page ranges were pruned to; 0: none
    window: int = 0

    @property
    def n_items(self) -> int:
        return int(self.work.shape[0])

    @property
    def num_ctas(self) -> int:
        return int(self.cta_offsets.shape[0] - 1)


def _as_int_vector(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _water_fill(sc: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Assign items ``sc`` (sorted by decreasing cost) on top of ``loads`` (updated in
    place) by water filling: find the level W with sum(max(0, W - load)) == sum(sc), lay
    the CTAs' deficits W - load end to end (least-loaded CTA first) and give each item to
    the CTA whose deficit interval contains the item's midpoint on the cumulative-cost
    line.  Every receiving CTA ends <= W + max(sc) and W <= final mean load."""
    c = loads.shape[0]
    perm = np.argsort(loads, kind="stable")
    lo = loads[perm]
    rest = float(sc.sum())
    levels = (np.cumsum(lo) + rest) / np.arange(1, c + 1)
    above = np.flatnonzero(levels[:-1] <= lo[1:])
    k = int(above[0]) + 1 if above.size else c  # number of CTAs under water
    level = levels[k - 1]
    deficit = np.maximum(level - lo[:k], 0.0)
    ends = np.cumsum(deficit)
    mids = np.cumsum(sc) - 0.5 * sc
    pos = np.minimum(np.searchsorted(ends, mids, side="right"), k - 1)
    tgt = perm[pos]
    loads += np.bincount(tgt, weights=sc, minlength=c)
    return tgt


def _balance(costs: np.ndarray, num_ctas: int):
    """Cost balancing of items over CTAs (LPT quality, vectorized, deterministic).

    1. Items costing more than ``_BIG_FRAC * mean`` go through exact LPT in decreasing
       cost order (ties: item index), each to the currently least-loaded CTA (ties: CTA
       index), batched: one numpy round assigns the longest prefix of LPT decisions that
       land on distinct CTAs in increasing-load order.
    2. The rest is grouped into size classes a factor 2 apart; class by class, biggest
       first, items (in index order) are water-filled on top of the current loads
       (``_water_fill``), each class evening out what the bigger ones left behind.
    Both phases keep every CTA at most ``mean + max item`` (docs/planner.md).
    Returns (cta per item int64, loads float64 [num_ctas]).
    """
    n = costs.shape[0]
    cta = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_ctas, dtype=np.float64)
    if n <= num_ctas:
        order = np.argsort(-costs, kind="stable")
        cta[order] = np.arange(n)
        loads[:n] = costs[order]
        return cta, loads
    mean = float(costs.sum()) / num_ctas
    big = np.flatnonzero(costs > _BIG_FRAC * mean)
    rest = np.flatnonzero(costs <= _BIG_FRAC * mean)
    if big.size:
        order = big[np.argsort(-costs[big], kind="stable")]
        sc = costs[order]
        nb = order.shape[0]
        i = 0
        rounds = 0
        while i < nb and rounds < _MAX_LPT_ROUNDS:
            perm = np.argsort(loads, kind="stable")
            lo = loads[perm]
            m = min(num_ctas, nb - i)
            if m > 1:
                reach = np.minimum.accumulate(lo[: m - 1] + sc[i : i + m - 1])
                stop = np.flatnonzero(lo[1:m] > reach)
                if stop.size:
                    m = int(stop[0]) + 1
            tgt = perm[:m]
            cta[order[i : i + m]] = tgt
            loads[tgt] += sc[i : i + m]
            i += m
            rounds += 1
        if i < nb:  # LPT round budget exhausted: the tail joins the water-filled items
            rest = np.sort(np.concatenate([order[i:], rest]))
    if rest.size:
        c = costs[rest]
        cmax = float(c.max())
        if cmax > 0.0:
            ratio = cmax / np.maximum(c, cmax * 2.0 ** -(_MAX_FILL_CLASSES - 1))
            cls = np.minimum(np.floor(np.log2(ratio)), _MAX_FILL_CLASSES - 1).astype(np.uint8)
        else:
            cls = np.zeros(rest.shape[0], dtype=np.uint8)
        by_cls = np.argsort(cls, kind="stable")  # radix sort; index order inside a class
        bounds = np.concatenate([[0], np.cumsum(np.bincount(cls, minlength=_MAX_FILL_CLASSES))])
        for k in range(_MAX_FILL_CLASSES):
            if bounds[k + 1] > bounds[k]:
                seg = rest[by_cls[bounds[k] : bounds[k + 1]]]
                cta[seg] = _water_fill(costs[seg], loads)
    return cta, loads


def _refine(costs: np.ndarray, cta: np.ndarray, num_ctas: int,
            rounds: int = _REFINE_ROUNDS) -> np.ndarray:
    """Local search on an assignment (``cta`` per item; a new array is returned): each
    round takes the costliest and the cheapest CTA and applies the one move (an item of
    the costliest to the cheapest) or swap (an item of each) whose transferred cost is
    closest to half their gap, among those that lower the costliest of the two.  No CTA
    ever ends above the old maximum, every item stays assigned once, and ties resolve by
    the lowest index, so the result is deterministic.  The water fill of ``_balance``
    leaves up to ~1-3% between the costliest CTA and the mean on prefill plans (e.g. 1.2%
    on one 8192-token prefill at 28/4 heads, 128-row tiles, against 0.3% for exact LPT);
    this closes most of it in about a millisecond on the largest plans."""
    cta = cta.copy()
    if costs.shape[0] <= 1 or num_ctas <= 1:
        return cta
    loads = np.bincount(cta, weights=costs, minlength=num_ctas).astype(np.float64)
    # no assignment beats max(mean, costliest item): stop within _REFINE_TOL of that
    bound = max(float(loads.sum()) / num_ctas, float(costs.max())) * (1.0 + _REFINE_TOL)
    best_top, stall = float(loads.max()), 0
    for _ in range(int(rounds)):
        hi = int(np.argmax(loads))
        lo = int(np.argmin(loads))
        gap = loads[hi] - loads[lo]
        if gap <= 0.0 or loads[hi] <= bound:
            break
        a = np.flatnonzero(cta == hi)
        b = np.flatnonzero(cta == lo)
        ca, cb = costs[a], costs[b]
        delta = np.concatenate([ca, (ca[:, None] - cb[None, :]).ravel()])
        ok = (delta > 0.0) & (delta < gap)
        if not ok.any():
            break
        k = int(np.argmin(np.where(ok, np.abs(delta - 0.5 * gap), np.inf)))
        if k < a.shape[0]:
            cta[a[k]] = lo
        else:
            i, j = divmod(k - a.shape[0], b.shape[0])
            cta[a[i]] = lo
            cta[b[j]] = hi
        loads[hi] -= delta[k]
        loads[lo] += delta[k]
        # several CTAs tied at the top: stop once a few rounds no longer lower the maximum
        top = float(loads.max())
        stall = stall + 1 if top >= best_top else 0
        best_top = min(best_top, top)
        if stall >= _REFINE_STALL:
            break
    return cta


def _expand_splits(n_pages: np.ndarray, splits: np.ndarray):
    """Tile -> item expansion: (tile index, split index, first page, end page) per item."""
    total = int(splits.sum())
    tile = np.repeat(np.arange(n_pages.shape[0], dtype=np.int64), splits)
    starts = np.cumsum(splits) - splits
    sidx = np.arange(total, dtype=np.int64) - starts[tile]
    s = splits[tile]
    n = n_pages[tile]
    p0 = sidx * n // s
    p1 = (sidx + 1) * n // s
    return tile, sidx, p0, p1


def _empty_plan(num_ctas: int, fresh_kv: bool = False, unpacked: bool = False,
                tile_m: int = 64, window: int = 0) -> Plan:
    return Plan(
        work=np.zeros((0, WORK_COLS), dtype=np.int32),
        cta_offsets=np.zeros(num_ctas + 1, dtype=np.int32),
        num_splits_max=1,
        partial_rows=0,
        cta_cost=np.zeros(num_ctas, dtype=np.float64),
        item_cost=np.zeros(0, dtype=np.float64),
        partial_offsets=np.zeros(0, dtype=np.int32),
        combine=np.zeros((0, COMBINE_COLS), dtype=np.int32),
        modeled_us=0.0,
        fresh_kv=fresh_kv,
        unpacked=unpacked,
        tile_m=tile_m,
        window=int(window),
    )


@dataclass(frozen=True)
class _Tiles:
    """One entry per q tile of a batch, ordered (b, h, q head slot, q tile)."""
    req: np.ndarray  # request
    head: np.ndarray  # KV head
    qhead: np.ndarray  # q head of an unpacked tile, -1 for packed tiles
    tok0: np.ndarray  # first token of the tile in its request
    ntok: np.ndarray  # tokens in the tile
    ntr: np.ndarray  # q tiles per slot of the tile's request
    n_pages: np.ndarray  # KV pages (fused writeback: KV units) the tile reads
    first: np.ndarray  # its first page (unit): 0, or where a sliding window starts
    rows: np.ndarray  # MMA rows carrying data
    unp: np.ndarray  # tile of an unpacked request
    pu: np.ndarray  # modeled us per page
    f_un: np.ndarray  # modeled fixed us, unsplit
    f_sp: np.ndarray  # modeled fixed us, split
    #: partial workspace rows a tile's split group takes per split: ntok * Gp (packed rows
    #: are t * Gp + g); the G unpacked tiles of one token range share one group, counted
    #: by its q head 0 tile
    group_rows: np.ndarray


def plan(
    query_start_loc,
    seq_lens,
    *,
    num_kv_heads: int,
    group_size: int,
    page_size: int = PAGE_SIZE,
    num_ctas: int = 132,
    tile_m: int = 64,
    allow_split: bool = True,
    max_splits: int = 16,
    cost_model: CostModel | None = None,
    max_partial_rows: int | None = None,
    fresh_kv: bool = False,
    unpacked_prefill: bool = False,
    window: int = 0,
) -> Plan:
    """Build the phantom-free, cost-balanced work list (see module docstring).

    ``fresh_kv=True`` plans for the fused-writeback kernel: work columns P0/P1 then index
    KV *units* instead of cache pages (``kv_units``): a q tile reads the request's
    ``ceil(ctx / P)`` old pages plus the fresh tiles its tokens need.
    ``unpacked_prefill=True`` tiles long prefill rows of a padded GQA group (G < Gp) one
    q head x ``tile_m`` tokens per item (QHEAD >= 0, rule: ``unpacked_requests``); the
    plan then runs on the kernel's unpacked tiles.
    ``window`` > 0 (tokens, a sliding-window layer): a query at position p sees keys
    ``p - window + 1 ..= p``; every page (unit) wholly before a tile's first query's window
    is left out of its item (phantom tiles of the window never run), and the kernel masks
    the partial pages at the window's edge.
    """
    cm = DEFAULT_COST_MODEL if cost_model is None else cost_model
    num_kv_heads = int(num_kv_heads)
    group_size = int(group_size)
    page_size = int(page_size)
    num_ctas = int(num_ctas)
    tile_m = int(tile_m)
    max_splits = int(max_splits)
    if num_kv_heads < 1 or group_size < 1 or page_size < 1 or num_ctas < 1 or max_splits < 1:
        raise ValueError("num_kv_heads, group_size, page_size, num_ctas, max_splits must be >= 1")
    gp = next_pow2(group_size)
    if tile_m < gp or tile_m % gp:
        raise ValueError(f"tile_m={tile_m} must be a multiple of Gp={gp}")
    window = int(window)
    if window < 0:
        raise ValueError(f"window must be >= 0 tokens (0: none), got {window}")

    qsl = _as_int_vector(query_start_loc, "query_start_loc")
    sl = _as_int_vector(seq_lens, "seq_lens")
    if qsl.shape[0] != sl.shape[0] + 1:
        raise ValueError(f"query_start_loc has {qsl.shape[0]} entries, expected len(seq_lens)+1")
    if qsl[0] != 0:
        raise ValueError("query_start_loc[0] must be 0")
    q_len = np.diff(qsl)
    if np.any(q_len < 0):
        raise ValueError("query_start_loc must be non-decreasing")
    if np.any(sl < 0):
        raise ValueError("seq_lens must be >= 0")
    live = (q_len > 0) & (sl > 0)
    if np.any(live & (sl < q_len)):
        bad = int(np.flatnonzero(live & (sl < q_len))[0])
        raise ValueError(f"seq_lens[{bad}]={int(sl[bad])} < q_len={int(q_len[bad])}")
    if not np.any(live):
        return _empty_plan(num_ctas, fresh_kv, bool(unpacked_prefill), tile_m, window)
    if int(sl.max()) > np.iinfo(np.int32).max or int(qsl[-1]) > np.iinfo(np.int32).max:
        raise OverflowError("sequence lengths / token counts must fit in int32")

    unp = np.zeros(sl.shape[0], dtype=bool)
    if unpacked_prefill:
        unp = unpacked_requests(qsl, sl, group_size=group_size, page_size=page_size,
                                tile_m=tile_m, cost_model=cm, fresh_kv=fresh_kv)
    t = _tiles(q_len, sl, live, unp, num_kv_heads=num_kv_heads, group_size=group_size,
               page_size=page_size, tile_m=tile_m, cm=cm, fresh_kv=fresh_kv, window=window)

    # no-split schedule, then the split-KV search against it
    ones = np.ones(t.n_pages.shape[0], dtype=np.int64)
    cost0 = t.f_un + t.n_pages * t.pu
    cta0, loads0 = _balance(cost0, num_ctas)
    best, best_comb = (ones, cta0, cost0), 0.0
    if allow_split and max_splits > 1:
        found = _search_splits(t, cost0, float(loads0.max()), tile_m=tile_m,
                               num_ctas=num_ctas, max_splits=max_splits, cm=cm,
                               max_partial_rows=max_partial_rows)
        if found is not None:
            best, best_comb = found

    splits, cta, item_cost = best
    cta = _refine(item_cost, cta, num_ctas)
    if splits is not ones:
        # the split was chosen on unrefined makespans: keep it only if it still beats the
        # refined no-split schedule (so splitting never models worse than not)
        cta0r = _refine(cost0, cta0, num_ctas)
        split_total = float(np.bincount(cta, weights=item_cost, minlength=num_ctas).max())
        if float(np.bincount(cta0r, weights=cost0, minlength=num_ctas).max()) <= (
                split_total + best_comb):
            splits, cta, item_cost = ones, cta0r, cost0
    return _materialize(t, splits, cta, item_cost, gp=gp, tile_m=tile_m, num_ctas=num_ctas,
                        cm=cm, fresh_kv=fresh_kv, unpacked=bool(unpacked_prefill),
                        window=window)


def _tiles(q_len, sl, live, unp, *, num_kv_heads: int, group_size: int, page_size: int,
           tile_m: int, cm: CostModel, fresh_kv: bool, window: int = 0) -> _Tiles:
    """Every q tile with work: packed requests one slot (QHEAD -1) of tile_m // Gp tokens
    a tile; unpacked requests G slots (q heads) of tile_m tokens a tile.  With a
    ``window``, a tile's pages start at its first query's window (``window_first``)."""
    gp = next_pow2(group_size)
    tpt_r = np.where(unp, tile_m, tile_m // gp)
    slots_r = np.where(unp, group_size, 1)
    nt = np.where(live, (q_len + tpt_r - 1) // tpt_r, 0)  # q tiles per request (and slot)
    per_head = nt * slots_r
    per_req = per_head * num_kv_heads
    req = np.repeat(np.arange(sl.shape[0], dtype=np.int64), per_req)
    k = np.arange(req.shape[0], dtype=np.int64) - (np.cumsum(per_req) - per_req)[req]
    ntr = nt[req]
    head = k // per_head[req]
    rem = k % per_head[req]
    tile_unp = unp[req]
    qhead = np.where(tile_unp, rem // np.maximum(ntr, 1), -1)
    tt = tpt_r[req]
    tok0 = (rem % np.maximum(ntr, 1)) * tt
    ql = q_len[req]
    ntok = np.minimum(tt, ql - tok0)
    if fresh_kv:
        # old pages 0 .. ceil(ctx / P) - 1, then fresh tiles 0 .. (last new token) // P
        n_pages = kv_units(sl[req] - ql, tok0 + ntok - 1, page_size)
    else:
        last_pos = sl[req] - ql + tok0 + ntok - 1  # absolute position of the tile's last token
        n_pages = last_pos // page_size + 1  # causal bound: pages 0 .. last_pos // P
    first = window_first(sl[req] - ql, tok0, window, page_size, fresh_kv)
    n_pages = n_pages - first
    # MMA rows carrying data: packed tiles Gp per token (padding loaded too), unpacked 1
    rows = np.where(tile_unp, ntok, ntok * gp)
    # per-tile cost pieces (tables over rows = 0 .. tile_m, then gathered)
    rows_tab = np.arange(tile_m + 1, dtype=np.int64)
    return _Tiles(req=req, head=head, qhead=qhead, tok0=tok0, ntok=ntok, ntr=ntr,
                  n_pages=n_pages, first=first, rows=rows, unp=tile_unp,
                  group_rows=np.where(qhead <= 0, ntok * gp, 0),
                  pu=cm.page_us(rows_tab, page_size)[rows],
                  f_un=cm.fixed_us(rows_tab, False)[rows],
                  f_sp=cm.fixed_us(rows_tab, True)[rows])


def _search_splits(t: _Tiles, cost0, best_total: float, *, tile_m: int, num_ctas: int,
                   max_splits: int, cm: CostModel, max_partial_rows):
    """The split-KV configuration that beats the no-split makespan ``best_total`` by
    ``cm.split_min_gain`` with the lowest modeled makespan: ((splits, cta, item_cost),
    combine us), or None.  Any split config costs >= mean + combine launch (splitting only
    adds work): the search is pruned when that cannot win."""
    n_pages, pu, f_un, f_sp, rows = t.n_pages, t.pu, t.f_un, t.f_sp, t.rows
    s_cap = np.minimum(max_splits, n_pages)
    target = best_total * (1.0 - cm.split_min_gain)
    mean0 = float(cost0.sum()) / num_ctas
    if int(s_cap.max()) <= 1 or mean0 + cm.combine_launch_us >= target:
        return None
    # Candidate caps on pages per chunk: a tile with n pages gets min(ceil(n / cap),
    # max_splits, n) splits; caps are those that split the longest tile 2..max_splits ways.
    nmax = int(n_pages.max())
    s_try = np.arange(2, min(max_splits, nmax) + 1, dtype=np.int64)
    caps = np.unique((nmax + s_try - 1) // s_try)
    n_even = caps.shape[0]
    # partial splits: caps between nmax / 2 and nmax split only the tiles longer than
    # the cap, in two.  When every tile is about as long (a prefill chunk over a long
    # context: 3.4 unsplittable tiles a CTA at 128 rows) splitting all of them doubles
    # the partial traffic, while halving the longest fifth already evens out the CTAs.
    upper = n_pages[n_pages > -(-nmax // 2)]
    if upper.size:
        qs = np.quantile(upper, np.linspace(0.1, 0.9, _PARTIAL_SPLIT_CAPS),
                         method="lower").astype(np.int64)
        caps = np.concatenate([caps, np.setdiff1d(qs[qs < nmax], caps)])
    # the first n_even caps split every long tile evenly, the rest are partial splits;
    # each family gets its own _MAX_SPLIT_EVALS real evaluations
    family = (np.arange(caps.shape[0]) >= n_even).astype(np.int64)
    order = np.argsort(-caps, kind="stable")
    caps, family = caps[order], family[order]
    # Tiles with identical (pages, rows) behave identically: evaluate unique ones.
    key = (n_pages * (tile_m + 1) + rows) * 2 + t.unp
    _, uidx, ucnt = np.unique(key, return_index=True, return_counts=True)
    un, ucap, upu = n_pages[uidx], s_cap[uidx], pu[uidx]
    ucost0, uf_sp, urows = cost0[uidx], f_sp[uidx], rows[uidx]
    S = np.maximum(np.minimum(-(-un[None, :] // caps[:, None]), ucap[None, :]), 1)
    sp = S > 1
    total = ((np.where(sp, S * uf_sp + un * upu, ucost0)) * ucnt).sum(axis=1)
    max_item = np.where(sp, uf_sp + (-(-un // S)) * upu, ucost0).max(axis=1)
    min_item = np.where(sp, uf_sp + (un // S) * upu, ucost0).min(axis=1)
    count = (S * ucnt).sum(axis=1)
    # exact workspace rows of each cap (the unique tiles above merge q heads)
    s_full = np.maximum(np.minimum(-(-n_pages[None, :] // caps[:, None]), s_cap[None, :]), 1)
    part_rows = (np.where(s_full > 1, s_full, 0) * t.group_rows[None, :]).sum(axis=1)
    comb_bytes = (
        np.where(sp, S * urows * (cm.head_dim + 1) * cm.partial_bytes + urows * cm.head_dim * cm.q_bytes, 0)
        * ucnt
    ).sum(axis=1)
    comb = cm.combine_launch_us + comb_bytes / (cm.bytes_per_us * num_ctas)
    lb = np.maximum(np.maximum(total / num_ctas, max_item), -(-count // num_ctas) * min_item) + comb
    ok = sp.any(axis=1)
    if max_partial_rows is not None:
        ok &= part_rows <= int(max_partial_rows)
    found = None
    evals = [0, 0]
    for ci in np.argsort(lb, kind="stable"):
        if min(evals) >= _MAX_SPLIT_EVALS or lb[ci] >= min(target, best_total):
            break
        if not ok[ci] or evals[family[ci]] >= _MAX_SPLIT_EVALS:
            continue
        evals[family[ci]] += 1
        s_c = np.maximum(np.minimum(-(-n_pages // caps[ci]), s_cap), 1)
        tile, _, p0, p1 = _expand_splits(n_pages, s_c)
        split_c = s_c[tile] > 1
        cost_c = np.where(split_c, f_sp[tile], f_un[tile]) + (p1 - p0) * pu[tile]
        cta_c, loads_c = _balance(cost_c, num_ctas)
        tot_c = float(loads_c.max()) + float(comb[ci])
        if tot_c < min(target, best_total):
            best_total = tot_c
            found = ((s_c, cta_c, cost_c), float(comb[ci]))
    return found


def _materialize(t: _Tiles, splits, cta, item_cost, *, gp: int, tile_m: int, num_ctas: int,
                 cm: CostModel, fresh_kv: bool, unpacked: bool, window: int = 0) -> Plan:
    """The work list (items of each CTA contiguous), split-KV workspace rows and combine
    groups of the chosen schedule."""
    n_pages, qhead, ntok, tok0 = t.n_pages, t.qhead, t.ntok, t.tok0
    n_tiles = n_pages.shape[0]
    # Items are generated in (b, h, q tile, split) order; a stable sort by CTA keeps that
    # order inside each CTA (KV-head locality, deterministic).
    perm = np.argsort(cta.astype(np.uint16) if num_ctas <= 65536 else cta, kind="stable")
    n_items = perm.shape[0]
    split_any = n_items > n_tiles
    work = np.empty((n_items, WORK_COLS), dtype=np.int32)
    if split_any:
        tile, sidx, p0, p1 = _expand_splits(n_pages, splits)
        tile, sidx = tile[perm], sidx[perm]
        work[:, W.P0] = p0[perm] + t.first[tile]
        work[:, W.P1] = p1[perm] + t.first[tile]
        work[:, W.SPLIT] = sidx
        work[:, W.NSPLIT] = splits[tile]
    else:
        tile = perm
        work[:, W.P0] = t.first[tile]
        work[:, W.P1] = t.first[tile] + n_pages[tile]
        work[:, W.SPLIT] = 0
        work[:, W.NSPLIT] = 1
    work[:, W.REQ] = t.req[tile]
    work[:, W.HEAD] = t.head[tile]
    work[:, W.QSTART] = tok0[tile]
    work[:, W.QLEN] = ntok[tile]
    work[:, W.QHEAD] = qhead[tile]

    # workspace: one block per split packed tile, one per split (b, h, token range) of
    # unpacked tiles (led by its q head 0 tile, whose index is this tile's minus
    # q head * tiles per slot: tiles run (b, h, q head slot, q tile))
    g_idx = np.flatnonzero((splits > 1) & (qhead <= 0))
    grp_rows = splits[g_idx] * t.group_rows[g_idx]
    grp_base = np.cumsum(grp_rows) - grp_rows
    partial_rows = int(grp_rows.sum())
    if partial_rows > np.iinfo(np.int32).max:
        raise OverflowError("partial workspace rows do not fit in int32")
    if split_any:
        base_of_tile = np.full(n_tiles, -1, dtype=np.int64)
        base_of_tile[g_idx] = grp_base
        qh_t = np.maximum(qhead[tile], 0)
        lead = tile - qh_t * t.ntr[tile]
        # packed: the split's first row; unpacked: block base + q head (chunked rows)
        first = np.where(qhead[tile] >= 0, base_of_tile[lead] + qh_t,
                         base_of_tile[lead] + sidx * ntok[tile] * gp)
        poff = np.where(splits[tile] > 1, first, -1).astype(np.int32)
    else:
        poff = np.full(n_items, -1, dtype=np.int32)
    # combine groups: the packed block as it is; an unpacked block as its chunks of c
    # tokens, chunk k at base + k * S * 64 (64 = c * Gp rows a split)
    c_tok = 64 // gp
    n_chunk = np.where(qhead[g_idx] >= 0, -(-ntok[g_idx] // c_tok), 1)
    gi = np.repeat(np.arange(g_idx.shape[0], dtype=np.int64), n_chunk)
    kk = np.arange(gi.shape[0], dtype=np.int64) - np.repeat(np.cumsum(n_chunk) - n_chunk, n_chunk)
    t_g = g_idx[gi]
    chunked = qhead[t_g] >= 0
    combine = np.empty((t_g.shape[0], COMBINE_COLS), dtype=np.int32)
    combine[:, W.C_REQ] = t.req[t_g]
    combine[:, W.C_HEAD] = t.head[t_g]
    combine[:, W.C_TOK0] = tok0[t_g] + np.where(chunked, kk * c_tok, 0)
    combine[:, W.C_NTOK] = np.where(chunked, np.minimum(c_tok, ntok[t_g] - kk * c_tok),
                                    ntok[t_g])
    combine[:, W.C_NSPLIT] = splits[t_g]
    combine[:, W.C_BASE] = grp_base[gi] + np.where(chunked, kk * splits[t_g] * 64, 0)

    offsets = np.zeros(num_ctas + 1, dtype=np.int32)
    np.cumsum(np.bincount(cta, minlength=num_ctas), out=offsets[1:])
    cta_cost = np.bincount(cta, weights=item_cost, minlength=num_ctas).astype(np.float64)
    g_all = np.flatnonzero(splits > 1)
    comb_us = cm.combine_us(splits[g_all], t.rows[g_all], num_ctas)
    return Plan(
        work=work,
        cta_offsets=offsets,
        num_splits_max=int(splits.max()),
        partial_rows=partial_rows,
        cta_cost=cta_cost,
        item_cost=np.ascontiguousarray(item_cost[perm], dtype=np.float64),
        partial_offsets=poff,
        combine=combine,
        modeled_us=float(cta_cost.max()) + comb_us,
        fresh_kv=bool(fresh_kv),
        unpacked=bool(unpacked),
        tile_m=tile_m,
        window=int(window),
    )


def _checked_lengths(query_start_loc, seq_lens, page_size: int):
    """(q_len, seq_lens) as int64 vectors, or None for a batch (or page size) ``plan``
    would refuse."""
    if page_size < 1:
        return None
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    if qsl.ndim != 1 or sl.ndim != 1 or qsl.shape[0] != sl.shape[0] + 1 or qsl[0] != 0:
        return None
    q = np.diff(qsl)
    if q.size and (int(q.min()) < 0 or int(sl.min()) < 0
                   or int(sl.max()) > np.iinfo(np.int32).max
                   or bool(np.any((q > 0) & (sl > 0) & (sl < q)))):
        return None
    return q, sl


def _one_token_units(sl: np.ndarray, page_size: int, fresh_kv: bool) -> np.ndarray:
    """Pages (``fresh_kv``: KV units) the single q tile of a one-new-token row reads."""
    if fresh_kv:  # kv_units(ctx = seq_len - 1, last new token 0)
        return -(-(sl - 1) // page_size) + 1
    return (sl - 1) // page_size + 1  # causal bound of the token at position seq_len - 1


def plan_reuse_key(query_start_loc, seq_lens, *, page_size: int = PAGE_SIZE,
                   fresh_kv: bool = False) -> bytes | None:
    """What ``plan`` reads of the batch, as bytes: two batches with equal keys get equal
    plans from ``plan`` called with the same options (``tile_m``, ``num_ctas``, cost model,
    ...), so a caller may reuse the previous step's plan instead of planning again.
    ``None`` for a batch ``plan`` would refuse (it then raises as usual).

    ``plan`` reads a request's exact ``seq_len`` only when it has more than one new token
    (prefill tiles: causal page bounds, ``unpacked_requests``).  A decode row (one new
    token) enters only through the number of pages (``fresh_kv``: KV units) its single tile
    reads, so in a run of decode steps the key changes only when some request crosses a
    page boundary: with 64-token pages and 32 requests, about 60% of steps plan nothing.
    Rows without new tokens or without KV are phantoms and count as 0."""
    qs = _checked_lengths(query_start_loc, seq_lens, page_size)
    if qs is None:
        return None
    q, sl = qs
    live = (q > 0) & (sl > 0)
    v = np.where(live, np.where(q > 1, sl, _one_token_units(sl, page_size, fresh_kv)), 0)
    return q.tobytes() + v.tobytes()


def _as_writable_int32(buf, name: str) -> np.ndarray:
    """numpy view of a numpy array or a CPU torch tensor (shares memory, no copy)."""
    if not isinstance(buf, np.ndarray) and hasattr(buf, "numpy"):
        buf = buf.numpy()  # CPU (pinned) torch tensor: shared-memory view
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{name} must be a numpy array or CPU torch tensor")
    if buf.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {buf.dtype}")
    if not buf.flags.c_contiguous or not buf.flags.writeable:
        raise ValueError(f"{name} must be C-contiguous and writeable")
    return buf


def pack_plan(
    plan: Plan,
    work_buf,
    offsets_buf,
    partial_offsets_buf=None,
    combine_buf=None,
    *,
    prev_n_items: int | None = None,
    prev_n_groups: int | None = None,
) -> int:
    """Copy ``plan`` into preallocated int32 buffers in place; returns n_items.

    * ``work_buf``: ``[cap, WORK_COLS]`` (or flat); rows ``>= n_items`` are zeroed
      (an all-zero row is an empty item: 0 tokens, pages [0, 0)).  If ``prev_n_items`` is
      given, only rows ``[n_items, prev_n_items)`` are cleared: the caller guarantees rows
      beyond ``prev_n_items`` are still zero from an earlier ``pack_plan``.
    * ``offsets_buf``: ``[>= num_ctas + 1]``; entries past ``num_ctas`` get ``n_items``
      (extra CTAs see empty ranges).
    * ``partial_offsets_buf`` (optional): ``[cap]``; padding ``-1``.
    * ``combine_buf`` (optional): ``[cap_groups, COMBINE_COLS]``; padding rows zero (0 splits).  With
      ``prev_n_items``, rows up to ``max(prev_n_groups, prev_n_items)`` are cleared: give
      ``prev_n_groups`` when an earlier plan may have had more split groups than items
      (an unpacked split token range makes a group per 64 // Gp tokens).
    Torch CPU tensors (pinned or not) are written through a shared-memory numpy view.
    """
    n = plan.n_items
    w = _as_writable_int32(work_buf, "work_buf")
    w2 = w.reshape(-1, WORK_COLS) if w.ndim == 1 else w
    if w2.ndim != 2 or w2.shape[1] != WORK_COLS:
        raise ValueError(f"work_buf must be [cap, {WORK_COLS}], got {w.shape}")
    cap = w2.shape[0]
    if n > cap:
        raise ValueError(f"plan has {n} items but work_buf holds {cap}")
    o = _as_writable_int32(offsets_buf, "offsets_buf")
    if o.ndim != 1 or o.shape[0] < plan.num_ctas + 1:
        raise ValueError(f"offsets_buf must be 1-D with >= {plan.num_ctas + 1} entries")
    end = cap if prev_n_items is None else min(cap, max(int(prev_n_items), n))

    w2[:n] = plan.work
    w2[n:end] = 0
    o[: plan.num_ctas + 1] = plan.cta_offsets
    o[plan.num_ctas + 1 :] = n
    if partial_offsets_buf is not None:
        p = _as_writable_int32(partial_offsets_buf, "partial_offsets_buf")
        if p.ndim != 1 or p.shape[0] < n:
            raise ValueError("partial_offsets_buf too small")
        p[:n] = plan.partial_offsets
        p[n : (p.shape[0] if prev_n_items is None else min(p.shape[0], end))] = -1
    if combine_buf is not None:
        c = _as_writable_int32(combine_buf, "combine_buf")
        c2 = c.reshape(-1, COMBINE_COLS) if c.ndim == 1 else c
        g = plan.combine.shape[0]
        if c2.ndim != 2 or c2.shape[1] != COMBINE_COLS or c2.shape[0] < g:
            raise ValueError(f"combine_buf must be [>= n_groups, {COMBINE_COLS}]")
        c2[:g] = plan.combine
        # rows past the earlier plan's groups are still zero
        gend = c2.shape[0]
        if prev_n_items is not None:
            gend = min(gend, max(end, g, 0 if prev_n_groups is None else int(prev_n_groups)))
        c2[g:gend] = 0
    return n


def worst_case_items(
    max_num_reqs: int,
    max_num_tokens: int,
    max_model_len: int,
    num_kv_heads: int,
    group_size: int,
    page_size: int = PAGE_SIZE,
    tile_m: int = 64,
    max_splits: int = 16,
    fresh_kv: bool = False,
    unpacked_prefill: bool = False,
) -> int:
    """Upper bound on ``plan(...).n_items`` over every batch with <= max_num_reqs requests,
    <= max_num_tokens new tokens in total and seq_lens <= max_model_len.
    With ``fresh_kv`` a tile reads ceil(ctx / P) + ceil(q / P) <= ceil(L / P) + 1 units.

    q tiles: a request with q new tokens has ceil(q / tpt) <= (q + tpt - 1) / tpt tiles and
    at most min(max_num_reqs, max_num_tokens) requests are non-empty, so
    tiles <= min(T, floor((T + R * (tpt - 1)) / tpt)).  Each (tile, head) becomes at most
    min(max_splits, ceil(max_model_len / page_size)) items (a split keeps >= 1 page).
    ``unpacked_prefill`` (G < Gp): an unpacked request (q >= tile_m new tokens, so at most
    floor(T / tile_m) of them) has G * ceil(q / tile_m) tiles per KV head, i.e. at most
    G * floor((T + R_u * (tile_m - 1)) / tile_m) in all, R_u = min(R, T // tile_m), each
    split at most as often as a packed tile; the bound adds that to the packed bound (each
    request is one kind or the other).
    """
    t = int(max_num_tokens)
    if t <= 0 or max_num_reqs <= 0 or max_model_len <= 0:
        return 0
    tpt = int(tile_m) // next_pow2(group_size)
    if tpt < 1:
        raise ValueError("tile_m smaller than Gp")
    r = min(int(max_num_reqs), t)
    tiles = min(t, (t + r * (tpt - 1)) // tpt)
    max_pages = -(-int(max_model_len) // int(page_size)) + (1 if fresh_kv else 0)
    bound = tiles * int(num_kv_heads) * max(1, min(int(max_splits), max_pages))
    g = int(group_size)
    if unpacked_prefill and g < next_pow2(g):
        tm = int(tile_m)
        r_u = min(r, t // tm)
        bound += (g * int(num_kv_heads) * ((t + r_u * (tm - 1)) // tm)
                  * max(1, min(int(max_splits), max_pages)))
    return bound


def worst_case_groups(max_num_reqs: int, max_num_tokens: int, max_model_len: int,
                      num_kv_heads: int, group_size: int, page_size: int = PAGE_SIZE) -> int:
    """Upper bound on ``plan(...).combine.shape[0]`` (split groups) over the same batches
    as ``worst_case_items``, for every ``tile_m``, split count and option.  A packed split
    tile is one group and holds at least the tokens of a 64-row tile (``64 // Gp``) unless
    it is its row's last; an unpacked split token range is one group per ``64 // Gp``
    tokens, shared by its G q heads.  Either way a (request, KV head) has at most as many
    groups as it has 64-row packed tiles: ``worst_case_items(..., tile_m=64,
    max_splits=1)``."""
    return worst_case_items(max_num_reqs, max_num_tokens, max_model_len, num_kv_heads,
                            group_size, page_size=page_size, tile_m=64, max_splits=1)
