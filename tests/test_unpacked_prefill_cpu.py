"""CPU tests of unpacked prefill q tiles (one q head x 64 tokens per item, work col 8).

* Planner (``plan(..., unpacked_prefill=True)``): an independent checker recomputes, per
  (request, q head, new token), every KV page (or, with ``fresh_kv``, KV unit) the causal
  attention needs, and demands that the packed + unpacked items of the plan cover each
  (token, q head, page) triple exactly once, with no phantom page, unpacked items never
  split, decode rows / G == Gp models always packed, and the rule of
  ``planner.unpacked_requests`` reproduced from a brute-force cost comparison.
* ``worst_case_items(..., unpacked_prefill=True)`` bounds random plans; determinism;
  default plans keep col 8 = -1; fused-writeback ownership goes to q head 0 only.
* sm_90a compile of every ``IonAttentionSm90(unpacked_prefill=True)`` variant (plain and
  fused) from fake tensors: wgmma, TMA loads (one more Q load site per 64 columns of D
  than the default kernel: the second, 1-head x 64-token Q atom), no local-memory or
  ptxas spills; the option off compiles exactly the default kernel.
"""
from __future__ import annotations

import numpy as np
import pytest

from cute_kernels.planner import (
    W_QHEAD,
    WORK_COLS,
    CostModel,
    fresh_writeback_items,
    next_pow2,
    partial_row,
    plan,
    pack_plan,
    unpacked_requests,
    worst_case_groups,
    worst_case_items,
)

P = 64
CHEAP_SPLIT_MODEL = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                              combine_launch_us=0.0)


def qsl_of(q_lens):
    return np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))]).astype(np.int32)


def unit_of(pos, ctx, fresh):
    """KV page (or fresh_kv unit) holding absolute key position ``pos``."""
    if not fresh or pos < ctx:
        return pos // P
    return -(-ctx // P) + (pos - ctx) // P


def brute_need(q_lens, seq_lens, hq, fresh):
    """need[(b, q head, token)] = set of pages/units read by that query row."""
    need = {}
    for b, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        if ql == 0 or L == 0:
            continue
        ctx = L - ql
        for t in range(ql):
            units = {unit_of(pos, ctx, fresh) for pos in range(ctx + t + 1)}
            for hh in range(hq):
                need[(b, hh, t)] = units
    return need


def check_unpacked_plan(p, q_lens, seq_lens, *, hkv, g, fresh=False, max_splits=None,
                        tile_m=64):
    """Exact once-only coverage of (request, q head, token, page) by packed + unpacked
    items, and the split-KV workspace layout (``check_split_layout``); returns the set of
    requests that got unpacked items."""
    assert p.work.shape[1] == WORK_COLS == 9 and p.unpacked
    gp = next_pow2(g)
    tpt = tile_m // gp
    hq = hkv * g
    q = np.asarray(q_lens)
    sl = np.asarray(seq_lens)
    need = brute_need(q_lens, seq_lens, hq, fresh)
    seen = {}
    kind = {}
    for i, row in enumerate(p.work.tolist()):
        b, h, t0, nt, u0, u1, s, ns, qh = row
        assert q[b] > 0 and sl[b] > 0, f"item {i}: phantom request"
        assert 0 <= h < hkv and 0 <= u0 < u1
        assert ns >= 1 and 0 <= s < ns
        if max_splits is not None:
            assert ns <= max_splits
        ctx = int(sl[b] - q[b])
        limit = (-(-ctx // P) + (t0 + nt - 1) // P + 1) if fresh else -(-int(sl[b]) // P)
        assert u1 <= limit, f"item {i}: page/unit past the sequence (phantom)"
        if qh < 0:
            assert qh == -1
            assert 1 <= nt <= tpt and t0 % tpt == 0 and t0 + nt <= q[b], f"item {i}: tokens"
            heads = range(h * g, h * g + g)
        else:
            assert qh < g, f"item {i}: q head slot {qh} >= G"
            assert 1 <= nt <= tile_m and t0 % tile_m == 0 and t0 + nt <= q[b], \
                f"item {i}: tokens"
            heads = [h * g + qh]
        kind.setdefault(b, set()).add(qh >= 0)
        for u in range(u0, u1):
            # no phantom: some token of the tile needs the unit
            assert any(u in need[(b, heads[0], t)] for t in range(t0, t0 + nt)), \
                f"item {i}: unit {u} needed by no token of the tile"
        for hh in heads:
            for t in range(t0, t0 + nt):
                for u in range(u0, u1):
                    if u in need[(b, hh, t)]:
                        key = (b, hh, t, u)
                        assert key not in seen, f"items {seen[key]} and {i} both cover {key}"
                        seen[key] = i
    expect = {(b, hh, t, u) for (b, hh, t), units in need.items() for u in units}
    missing = expect - set(seen)
    assert not missing, f"uncovered (b, q head, token, unit): {sorted(missing)[:3]}"
    assert set(seen) == expect
    for b, kinds in kind.items():
        assert len(kinds) == 1, f"request {b} mixes packed and unpacked items"
    check_split_layout(p, g)
    return {b for b, kinds in kind.items() if True in kinds}


def check_split_layout(p, g):
    """Split groups and workspace rows, packed and unpacked (docs/contract.md): the items of
    one (b, KV head, tok0) tile (unpacked: all G q heads) share S and contiguous page
    ranges from page 0 split by split; each split item's rows (``partial_row``) are those
    of the layout written out here (packed: ``base + s * ntok * Gp + t * Gp + slot``;
    unpacked: chunks of ``c = 64 // Gp`` tokens, ``base + k * S * 64 + s * n_k * Gp +
    (t % c) * Gp + g``), every workspace row is written by at most one item and lies below
    ``partial_rows``, and ``combine`` lists exactly the groups: a packed tile, or one
    chunk of an unpacked token range, whose rows are each group's packed rows."""
    gp = next_pow2(g)
    c = 64 // gp
    groups = {}
    for i, row in enumerate(p.work.tolist()):
        b, h, t0, nt, u0, u1, s, ns, qh = row
        groups.setdefault((b, h, t0), []).append((qh, s, ns, u0, u1, nt, int(p.partial_offsets[i])))
    written = {}
    expect = []
    for (b, h, t0), items in sorted(groups.items()):
        ns, nt = items[0][2], items[0][5]
        assert all(it[2] == ns and it[5] == nt for it in items), f"group {(b, h, t0)}: mixed"
        heads = sorted({it[0] for it in items})
        assert heads == [-1] or heads == list(range(g)), f"group {(b, h, t0)}: q heads {heads}"
        ranges = None
        for qh in heads:
            mine = sorted((it[1], it[3], it[4], it[6]) for it in items if it[0] == qh)
            assert [m[0] for m in mine] == list(range(ns)), f"group {(b, h, t0)}: split indices"
            assert mine[0][1] == 0 and all(mine[k][2] == mine[k + 1][1] for k in range(ns - 1)), \
                f"group {(b, h, t0)}: split ranges not contiguous from page 0"
            r = [(m[1], m[2]) for m in mine]
            assert ranges is None or r == ranges, f"group {(b, h, t0)}: q heads split differently"
            ranges = r
        if ns == 1:
            assert all(it[6] == -1 for it in items), f"group {(b, h, t0)}: unsplit with offset"
            continue
        unpacked = heads != [-1]
        base = min(it[6] for it in items)
        if unpacked:
            chunks = [(k * c, min(c, nt - k * c)) for k in range(-(-nt // c))]
            for k, (k0, n_k) in enumerate(chunks):
                expect.append((b, h, t0 + k0, n_k, ns, base + k * ns * 64))
        else:
            expect.append((b, h, t0, nt, ns, base))
        for qh, s, _, _, _, _, poff in items:
            slots = range(g) if qh < 0 else [qh]
            assert poff == (base + qh if unpacked else base + s * nt * gp), \
                f"group {(b, h, t0)}: offset"
            for t in range(nt):
                for slot in slots:
                    prow = int(partial_row(poff, t, gp, qh, slot, s, ns, nt))
                    if unpacked:
                        k, n_k = t // c, min(c, nt - (t // c) * c)
                        want = base + k * ns * 64 + s * n_k * gp + (t % c) * gp + qh
                    else:
                        want = base + s * nt * gp + t * gp + slot
                    assert prow == want
                    assert 0 <= prow < p.partial_rows, "partial row out of the workspace"
                    assert prow not in written, f"partial row {prow} written twice"
                    written[prow] = (b, h, t0, s, t, slot)
    got = sorted(map(tuple, p.combine.tolist()))
    assert got == sorted(expect), "combine list"
    # what the combine pass reads (group row base + s * ntok * Gp + t * Gp + slot, slot < G)
    # is exactly what the items wrote, each row with the right (b, head, token, split)
    for b, h, tok0, ntok, ns, base in got:
        for s in range(ns):
            for t in range(ntok):
                for slot in range(g):
                    key = written.get(base + s * ntok * gp + t * gp + slot)
                    assert key is not None, f"combine group {(b, h, tok0)} reads an unwritten row"
                    kb, kh, kt0, ks, kt, kslot = key
                    assert (kb, kh, ks, kt0 + kt, kslot) == (b, h, s, tok0 + t, slot), \
                        f"combine group {(b, h, tok0)} reads another row's partial"
    assert p.partial_rows >= len(written)


def random_batch(rng, n_max=6):
    n = int(rng.integers(1, n_max + 1))
    q_lens, seq_lens = [], []
    for _ in range(n):
        kind = int(rng.integers(0, 6))
        if kind == 0:  # decode
            ql, L = 1, int(rng.integers(1, 400))
        elif kind == 1:  # prefill chunk, ctx not a page multiple
            ql = int(rng.integers(64, 300))
            L = ql + int(rng.integers(1, 200))
        elif kind == 2:  # fresh prefill
            ql = int(rng.integers(1, 300))
            L = ql
        elif kind == 3:  # no new token / empty
            ql, L = 0, int(rng.integers(0, 150))
        elif kind == 4:  # around the 64-token threshold
            ql = int(rng.choice([63, 64, 65, 127, 128, 129]))
            L = ql + int(rng.choice([0, 1, 63, 64, 100]))
        else:  # short prefill
            ql = int(rng.integers(2, 64))
            L = ql + int(rng.integers(0, 200))
        q_lens.append(ql)
        seq_lens.append(L)
    return q_lens, seq_lens


# ------------------------------------------------------------------------------ planner


@pytest.mark.parametrize("g", [3, 5, 7])
def test_unpacked_plan_covers_every_triple_once(g):
    rng = np.random.default_rng(10 + g)
    got_unpacked = got_split = 0
    for trial in range(10):
        q_lens, seq_lens = random_batch(rng)
        if trial % 3 == 0:
            q_lens.append(256)  # a long prefill row: unpacked
            seq_lens.append(256 + int(rng.integers(0, 130)))
        if trial % 2 == 0:
            q_lens.append(1)  # a long decode row: split-KV (packed items only)
            seq_lens.append(int(rng.integers(1500, 3000)))
        qsl = qsl_of(q_lens)
        sl = np.asarray(seq_lens, np.int32)
        for cm, nc, fresh in ((None, 132, False), (CHEAP_SPLIT_MODEL, 16, False),
                              (CHEAP_SPLIT_MODEL, 16, True)):
            p = plan(qsl, sl, num_kv_heads=2, group_size=g, num_ctas=nc, cost_model=cm,
                     max_splits=8, fresh_kv=fresh, unpacked_prefill=True)
            unp = check_unpacked_plan(p, q_lens, seq_lens, hkv=2, g=g, fresh=fresh,
                                      max_splits=8)
            rule = unpacked_requests(qsl, sl, group_size=g, cost_model=cm, fresh_kv=fresh)
            assert unp == set(np.flatnonzero(rule).tolist())
            for b in unp:
                assert q_lens[b] >= 64, "decode / short rows stay packed"
            got_unpacked += len(unp)
            got_split += int(p.num_splits_max > 1)
    assert got_unpacked > 0 and got_split > 0  # both paths exercised


def test_checker_rejects_corrupted_plans():
    import dataclasses

    q_lens, seq_lens = [1, 192, 100], [700, 256, 100]
    p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=7,
             num_ctas=8, unpacked_prefill=True)
    check_unpacked_plan(p, q_lens, seq_lens, hkv=2, g=7)
    unp = int(np.flatnonzero(p.work[:, W_QHEAD] >= 0)[0])

    def corrupt(fn):
        w = p.work.copy()
        fn(w)
        return dataclasses.replace(p, work=w)

    bad = [
        corrupt(lambda w: w.__setitem__((unp, W_QHEAD), (w[unp, W_QHEAD] + 1) % 7)),  # dup
        corrupt(lambda w: w.__setitem__((unp, 5), w[unp, 5] + 1)),  # phantom page
        corrupt(lambda w: w.__setitem__((unp, 7), 2)),  # unpacked split
        corrupt(lambda w: w.__setitem__((unp, 3), w[unp, 3] - 1)),  # token dropped
        corrupt(lambda w: w.__setitem__((unp, W_QHEAD), 7)),  # q head slot >= G
        dataclasses.replace(p, work=p.work[1:]),  # item dropped
    ]
    for i, c in enumerate(bad):
        with pytest.raises(AssertionError):
            check_unpacked_plan(c, q_lens, seq_lens, hkv=2, g=7)


def test_decode_rows_and_full_groups_stay_packed():
    q_lens, seq_lens = [1, 1, 4096, 500], [3000, 70, 4096, 700]
    qsl = qsl_of(q_lens)
    for g in (1, 2, 4, 8):  # G == Gp: nothing to gain
        p = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=g,
                 unpacked_prefill=True)
        assert (p.work[:, W_QHEAD] == -1).all() and p.unpacked
        ref = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=g)
        assert np.array_equal(p.work, ref.work)
    p = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=7,
             unpacked_prefill=True)
    qh = p.work[:, W_QHEAD]
    assert (qh[p.work[:, 0] < 2] == -1).all(), "decode rows are packed"
    assert (qh[p.work[:, 0] >= 2] >= 0).all(), "long prefill rows are unpacked"
    check_unpacked_plan(p, q_lens, seq_lens, hkv=2, g=7)


def test_default_plan_has_packed_items_only():
    q_lens, seq_lens = [8192, 1, 300], [8192, 900, 400]
    p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=4, group_size=7)
    assert p.work.shape[1] == 9 and (p.work[:, W_QHEAD] == -1).all() and not p.unpacked


def test_threshold_rule_g7():
    # G = 7 (Gp = 8, 8 tokens per packed tile): 64 new tokens -> 7 unpacked tiles instead of
    # 8 packed ones; 65 -> 14 instead of 9 stays packed; 63 (< 64) is never unpacked
    qsl = qsl_of([64, 65, 63, 128, 8192])
    sl = np.asarray([64, 65, 63, 128 + 64, 8192], np.int32)
    assert unpacked_requests(qsl, sl, group_size=7).tolist() == [True, False, False, True, True]
    # 28 q / 4 KV heads, prefill 8192: 4 * 7 * 128 unpacked items vs 4 * 1024 packed
    one = qsl_of([8192])
    a = plan(one, np.asarray([8192], np.int32), num_kv_heads=4, group_size=7,
             unpacked_prefill=True)
    b = plan(one, np.asarray([8192], np.int32), num_kv_heads=4, group_size=7)
    assert a.n_items == 4 * 7 * 128 and b.n_items == 4 * 1024 and a.num_splits_max == 1
    # 12.5% fewer MMA rows x pages (sum over items of 64 rows * pages read)
    assert (a.work[:, 5] - a.work[:, 4]).sum() * 8 == (b.work[:, 5] - b.work[:, 4]).sum() * 7
    assert a.modeled_us < b.modeled_us


def _brute_tiling_cost(ql, L, tokens, row_mult, cm):
    total = 0.0
    for t0 in range(0, ql, tokens):
        nt = min(tokens, ql - t0)
        pages = (L - ql + t0 + nt - 1) // P + 1
        total += float(cm.item_us(pages, nt * row_mult, P, False))
    return total


def test_rule_is_the_cost_comparison():
    cm = CostModel()
    rng = np.random.default_rng(3)
    for _ in range(60):
        g = int(rng.choice([3, 5, 6, 7]))
        gp = next_pow2(g)
        ql = int(rng.integers(1, 700))
        L = ql + int(rng.integers(0, 500))
        want = ql >= 64 and (g * _brute_tiling_cost(ql, L, 64, 1, cm)
                             < _brute_tiling_cost(ql, L, 64 // gp, gp, cm))
        got = unpacked_requests(qsl_of([ql]), np.asarray([L]), group_size=g, cost_model=cm)
        assert bool(got[0]) == want, (g, ql, L)


def test_unpacked_item_cost_counts_64_real_rows():
    cm = CostModel()
    p = plan(qsl_of([640]), np.asarray([700], np.int32), num_kv_heads=1, group_size=3,
             cost_model=cm, unpacked_prefill=True)
    w = p.work
    assert (w[:, W_QHEAD] >= 0).all() and sorted(set(w[:, W_QHEAD].tolist())) == [0, 1, 2]
    # 30 items on 132 CTAs: the long tiles split (since v18), and a split item's cost
    # counts its fp32 partial store
    assert (w[:, 7] > 1).any()
    exp = cm.item_us(w[:, 5] - w[:, 4], w[:, 3], P, w[:, 7] > 1)
    np.testing.assert_allclose(p.item_cost, exp)
    cta_of = np.repeat(np.arange(p.num_ctas), np.diff(p.cta_offsets))
    np.testing.assert_allclose(p.cta_cost, np.bincount(cta_of, weights=exp,
                                                       minlength=p.num_ctas))


def test_unpacked_plan_is_deterministic():
    rng = np.random.default_rng(5)
    for _ in range(5):
        q_lens, seq_lens = random_batch(rng)
        q_lens.append(400)
        seq_lens.append(450)
        args = (qsl_of(q_lens), np.asarray(seq_lens, np.int32))
        kw = dict(num_kv_heads=4, group_size=7, num_ctas=24, cost_model=CHEAP_SPLIT_MODEL,
                  unpacked_prefill=True)
        a, b = plan(*args, **kw), plan(*args, **kw)
        assert np.array_equal(a.work, b.work) and np.array_equal(a.cta_offsets, b.cta_offsets)
        assert np.array_equal(a.partial_offsets, b.partial_offsets)
        assert np.array_equal(a.combine, b.combine)


def test_worst_case_items_bounds_unpacked_plans():
    rng = np.random.default_rng(11)
    tight = 0
    for trial in range(60):
        q_lens, seq_lens = random_batch(rng, n_max=8)
        if trial % 2:
            q_lens = [int(rng.choice([64, 65, 128, 192]))] * int(rng.integers(1, 6))
            seq_lens = [ql + int(rng.integers(0, 3000)) for ql in q_lens]
        g = int(rng.choice([3, 5, 7]))
        ms = int(rng.choice([1, 2, 16]))
        fresh = bool(rng.integers(0, 2))
        p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=g,
                 num_ctas=int(rng.choice([8, 264])), cost_model=CHEAP_SPLIT_MODEL,
                 max_splits=ms, fresh_kv=fresh, unpacked_prefill=True)
        bound = worst_case_items(len(q_lens), max(1, sum(q_lens)), max(1, max(seq_lens)),
                                 2, g, max_splits=ms, fresh_kv=fresh, unpacked_prefill=True)
        assert p.n_items <= bound
        if p.n_items > worst_case_items(len(q_lens), max(1, sum(q_lens)),
                                        max(1, max(seq_lens)), 2, g, max_splits=ms,
                                        fresh_kv=fresh):
            tight += 1
    # the packed-only bound is not enough: 64 tokens, no split, G = 7 -> 7 items vs 8 tiles
    # with max_splits = 1; 128 tokens in 2 requests of 64 -> 14 items
    p = plan(qsl_of([64, 64]), np.asarray([64, 64], np.int32), num_kv_heads=1, group_size=7,
             max_splits=1, unpacked_prefill=True)
    assert p.n_items == 14
    assert p.n_items <= worst_case_items(2, 128, 64, 1, 7, max_splits=1, unpacked_prefill=True)
    # a G == Gp model needs no extra room
    assert worst_case_items(4, 512, 4096, 2, 8, unpacked_prefill=True) == \
        worst_case_items(4, 512, 4096, 2, 8)


def test_fresh_writeback_owner_is_q_head_zero():
    rng = np.random.default_rng(21)
    for _ in range(8):
        q_lens, seq_lens = random_batch(rng)
        q_lens.append(300)
        seq_lens.append(300 + int(rng.integers(0, 100)))
        g = int(rng.choice([3, 7]))
        hkv = 2
        qsl = qsl_of(q_lens)
        p = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=hkv, group_size=g,
                 num_ctas=16, cost_model=CHEAP_SPLIT_MODEL, fresh_kv=True,
                 unpacked_prefill=True)
        assert (p.work[:, W_QHEAD] >= 0).any()
        owners = fresh_writeback_items(p.work, qsl, np.asarray(seq_lens))
        keys = [tuple(r) for r in owners[:, 1:].tolist()]
        expect = sorted((b, h, k) for b, (ql, L) in enumerate(zip(q_lens, seq_lens))
                        if ql > 0 and L > 0 for h in range(hkv) for k in range(-(-ql // P)))
        assert sorted(keys) == expect and len(set(keys)) == len(keys), "one writer per tile"
        for item, b, h, k in owners.tolist():
            row = p.work[item]
            assert row[W_QHEAD] <= 0, "only packed items or q head 0 write back"
            n_old = -(-(seq_lens[b] - q_lens[b]) // P)
            assert row[4] <= n_old + k < row[5]
            assert row[2] <= min(64 * k + 63, q_lens[b] - 1) < row[2] + row[3]


def test_device_plan_records_unpacked():
    from cute_kernels.attention import DevicePlan, make_device_plan

    qsl, sl = qsl_of([1, 192]), np.asarray([65, 256], np.int32)
    pu = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, unpacked_prefill=True)
    pp = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8)
    assert (pu.work[:, W_QHEAD] >= 0).any()
    packed_only = DevicePlan(item_capacity=128, group_capacity=8, partial_rows_capacity=64,
                             num_ctas=8, head_dim=128, device="cpu")
    assert packed_only.work.shape == (128, 8)  # the default kernels' 8-column contract
    packed_only.upload(pp)
    np.testing.assert_array_equal(packed_only.work[:pp.n_items].numpy(), pp.work[:, :8])
    with pytest.raises(RuntimeError, match="unpacked=True"):
        packed_only.upload(pu)
    dp = DevicePlan(item_capacity=128, group_capacity=8, partial_rows_capacity=64, num_ctas=8,
                    head_dim=128, device="cpu", unpacked=True)
    assert dp.work.shape == (128, 9) and dp.unpacked is False
    assert dp.upload(pu).unpacked is True
    np.testing.assert_array_equal(dp.work[:pu.n_items].numpy(), pu.work)
    assert dp.upload(pp).unpacked is False
    assert not dp.work[pp.n_items:].any()
    md = make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, page_size=P, head_dim=128,
                          device="cpu", num_ctas=8, unpacked_prefill=True)
    assert md.unpacked and np.array_equal(md.work.numpy(), pu.work)


# ----------------------------------------------------------------------- sm_90a compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402


def _vid(v):
    return "-".join(str(x) for x in v)


def _sass(cubin):
    from test_fused_writeback_cpu import _sass as sass_of  # nvdisasm lookup, shared

    return sass_of(cubin)


def _tma_load_sites(art):
    return art.count(r"cp\.async\.bulk\.tensor\.\w+\.shared::cluster\.global") + \
        art.count(r"cp\.async\.bulk\.tensor\.\w+\.shared::cta\.global")


def _check_no_spills(art):
    assert not art.has("st.local") and not art.has("ld.local"), "local-memory spill in PTX"
    sass = _sass(art.cubin)
    if sass is not None:  # ptxas' own spills (setmaxnreg budgets)
        assert "HGMMA" in sass and "UTMALDG" in sass
        assert "STL" not in sass and "LDL" not in sass, "ptxas spilled registers"


_DEFAULT_LOADS = {}


def _default_load_sites(v):
    if v not in _DEFAULT_LOADS:
        art = compile_sm90a(attention.make_kernel(v), *attention.fake_args(v),
                            compile_options="--enable-tvm-ffi")
        _DEFAULT_LOADS[v] = (_tma_load_sites(art), art.ptx)
    return _DEFAULT_LOADS[v]


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_vid(v) for v in ALL_VARIANTS])
def test_unpacked_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_kernel(variant, unpacked=True),
                        *attention.fake_args(variant, True), compile_options="--enable-tvm-ffi",
                        keep_cubin=True)
    assert art.has("wgmma.mma_async") and art.has("setmaxnreg") and art.has("mbarrier.try_wait")
    assert art.has("cp.async.bulk.tensor")
    _check_no_spills(art)
    # the second Q atom (1 head x 64 tokens) adds one TMA load site per 64 columns of D
    base_loads, base_ptx = _default_load_sites(variant)
    assert _tma_load_sites(art) == base_loads + variant.head_dim // 64
    assert art.ptx != base_ptx


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_vid(v) for v in ALL_VARIANTS])
def test_fused_unpacked_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_fused_kernel(variant, unpacked=True),
                        *attention.fused_fake_args(variant, True),
                        compile_options="--enable-tvm-ffi",
                        keep_cubin=True)
    assert art.has("wgmma.mma_async") and art.has("setmaxnreg")
    stores = art.count(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta")
    # one TMA store per K/V and 64-column chunk; rows in the next page by plain stores
    assert stores == 2 * (variant.head_dim // 64), "fresh K/V writeback stores"
    assert art.count(r"st\.global\.b16") >= 2, "straddle rows by plain stores"
    assert art.has("cp.async.bulk.wait_group.read")
    _check_no_spills(art)


def test_option_off_is_the_default_kernel():
    """unpacked_prefill=False compiles exactly the default kernel (the option is
    compile-time only and adds nothing to the default code path)."""
    from cute_kernels.attention_sm90 import IonAttentionSm90
    from cute_kernels.variants import CTAS_PER_SM

    v = ALL_VARIANTS[7]  # bf16, D 128, Gp 8
    off = IonAttentionSm90(cutlass.BFloat16, v.head_dim, v.group_pad, v.page_size,
                           ctas_per_sm=CTAS_PER_SM, unpacked_prefill=False)
    a = compile_sm90a(off, *attention.fake_args(v), compile_options="--enable-tvm-ffi")
    loads, base_ptx = _default_load_sites(v)
    assert a.ptx == base_ptx
    assert _tma_load_sites(a) == loads == 3 * (v.head_dim // 64)  # Q, K, V only


# ------------------------------------------------------------------- split unpacked items (v18)


@pytest.mark.parametrize("fresh", [False, True])
def test_unpacked_items_split_to_balance_a_chunk_over_long_context(fresh):
    """A prefill chunk over a long cached context makes few unpacked tiles of about equal
    length (8 tiles x 7 q heads on 40 CTAs here; 2048 over 6144 cached at 28/4 heads makes
    3.4 tiles a CTA at 128 rows).  The planner now splits the longest of them; every q head
    of a split token range is split the same way and the group is one packed-layout
    combine group.  Exact coverage is checked token by token."""
    q_lens, seq_lens = [1024], [4096]
    p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=1, group_size=7,
             num_ctas=40, tile_m=128, fresh_kv=fresh, unpacked_prefill=True)
    unsplit = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=1,
                   group_size=7, num_ctas=40, tile_m=128, fresh_kv=fresh,
                   unpacked_prefill=True, allow_split=False)
    unp = p.work[:, W_QHEAD] >= 0
    assert unp.all()
    split = p.work[:, 7] > 1
    assert split.any() and not split.all(), "a partial split: only the longest tiles"
    assert p.modeled_us < unsplit.modeled_us * 0.97
    # a split token range: G heads x 2 splits; its combine groups: 128 // 8 chunks of the
    # 8 tokens of a 64-row packed tile
    assert p.combine.shape[0] == int(split.sum()) // (7 * 2) * (128 // 8)
    assert check_unpacked_plan(p, q_lens, seq_lens, hkv=1, g=7, fresh=fresh, tile_m=128) == {0}


@pytest.mark.parametrize("tile_m", [128, 192])
def test_chunk_2048_over_6144_at_28_4_heads_splits_unpacked_items(tile_m):
    """The chunk that was 0.93x FA3 on the H200 (bench/notes.md, v17): the planner splits
    some of its unpacked tiles and models a lower makespan than the unsplit plan; the
    workspace layout holds for the real shape and fits the backend's workspace."""
    qsl, sl = qsl_of([2048]), np.asarray([8192], np.int32)
    kw = dict(num_kv_heads=4, group_size=7, num_ctas=132, tile_m=tile_m, fresh_kv=True,
              unpacked_prefill=True, max_partial_rows=256 * 264)
    p = plan(qsl, sl, **kw)
    p0 = plan(qsl, sl, allow_split=False, **kw)
    assert p.num_splits_max == 2 and (p.work[:, W_QHEAD] >= 0).all()
    assert p.modeled_us < 0.97 * p0.modeled_us
    assert 0 < p.partial_rows <= 256 * 264
    check_split_layout(p, 7)
    # fresh tiles: still exactly one owner each
    own = fresh_writeback_items(p.work, qsl, sl)
    keys = {tuple(r[1:]) for r in own.tolist()}
    assert len(keys) == own.shape[0] == 4 * (2048 // 64)


def test_split_layout_checker_rejects_bad_offsets():
    import dataclasses

    q_lens, seq_lens = [1024], [4096]
    p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=1, group_size=7,
             num_ctas=40, tile_m=128, unpacked_prefill=True)
    check_split_layout(p, 7)
    i = int(np.flatnonzero(p.work[:, 7] > 1)[0])
    po = p.partial_offsets.copy()
    po[i] += 1  # onto the next q head's rows
    w = p.work.copy()
    j = int(np.flatnonzero((p.work[:, 7] > 1) & (p.work[:, 6] == 0))[0])
    w[j, 5] -= 1  # split 0 of one q head ends a page early: ranges no longer meet
    comb = p.combine.copy()
    comb[0, 5] += 8
    for bad in (dataclasses.replace(p, partial_offsets=po), dataclasses.replace(p, work=w),
                dataclasses.replace(p, combine=comb)):
        with pytest.raises(AssertionError):
            check_split_layout(bad, 7)


def test_worst_case_groups_bounds_split_plans_of_every_tile_size():
    """Random batches under the split-friendly cost model at 64, 128 and 192 rows, with
    and without fresh_kv: items within ``worst_case_items``, combine groups within
    ``worst_case_groups`` (which the backend sizes its group buffers with; the next
    test shows a plan with more groups than items)."""
    rng = np.random.default_rng(77)
    for trial in range(40):
        g = int(rng.choice([3, 7]))
        q_lens, seq_lens = random_batch(rng)
        q_lens.append(int(rng.integers(64, 400)))
        seq_lens.append(q_lens[-1] + int(rng.integers(200, 3000)))
        tm = int(rng.choice([64, 128, 192]))
        fresh = bool(trial % 2)
        p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=g,
                 num_ctas=16, tile_m=tm, cost_model=CHEAP_SPLIT_MODEL, max_splits=8,
                 fresh_kv=fresh, unpacked_prefill=True)
        check_split_layout(p, g)
        reqs, toks, lmax = len(q_lens), int(sum(q_lens)), int(max(seq_lens))
        assert p.n_items <= worst_case_items(reqs, toks, lmax, 2, g, tile_m=tm, max_splits=8,
                                             fresh_kv=fresh, unpacked_prefill=True)
        assert p.combine.shape[0] <= worst_case_groups(reqs, toks, lmax, 2, g)


def test_pack_plan_clears_the_groups_of_an_earlier_plan_with_more_groups_than_items():
    """A plan whose unpacked split ranges make more combine groups than items, then a
    small plan packed over it: with ``prev_n_groups`` the combine buffer equals a fresh
    pack (a stale group left behind would be merged again by the next combine launch,
    over rows of the new step).  ``DevicePlan.upload`` passes both counts."""
    big = plan(qsl_of([1000]), np.asarray([3000], np.int32), num_kv_heads=1,
               group_size=7, num_ctas=132, tile_m=128, unpacked_prefill=True)
    small = plan(qsl_of([1]), np.asarray([70], np.int32), num_kv_heads=1, group_size=7,
                 num_ctas=132, tile_m=128, unpacked_prefill=True)
    n_big, g_big = big.n_items, big.combine.shape[0]
    assert g_big > n_big
    cap = 4 * g_big
    bufs = [np.zeros((cap, 9), np.int32), np.zeros(133, np.int32),
            np.full(cap, -1, np.int32), np.zeros((cap, 6), np.int32)]
    pack_plan(big, *bufs)
    pack_plan(small, *bufs, prev_n_items=n_big, prev_n_groups=g_big)
    fresh = [np.zeros((cap, 9), np.int32), np.zeros(133, np.int32),
             np.full(cap, -1, np.int32), np.zeros((cap, 6), np.int32)]
    pack_plan(small, *fresh)
    for a, b in zip(bufs, fresh):
        assert np.array_equal(a, b)
    # without the group count, rows past the big plan's items would stay stale
    stale = [np.zeros((cap, 9), np.int32), np.zeros(133, np.int32),
             np.full(cap, -1, np.int32), np.zeros((cap, 6), np.int32)]
    pack_plan(big, *stale)
    pack_plan(small, *stale, prev_n_items=n_big)
    assert stale[3][n_big:g_big].any()
