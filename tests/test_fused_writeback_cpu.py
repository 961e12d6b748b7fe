"""CPU tests of the fused eager KV writeback ("fresh_kv") path.

* Planner (``plan(..., fresh_kv=True)``): the coverage checker recomputes, position by
  position and independently of the planner, which KV units every (request, KV head, new
  token) needs -- old cache pages holding positions < ctx, fresh tiles holding new tokens
  <= the token -- and demands exact once-only coverage, no phantom unit, consistent splits.
* Writeback ownership (``planner.fresh_writeback_items`` / ``fresh_tile_owned``, the rule
  the kernel applies per unit): a numpy model of the kernel's TMA stores (page / row offset
  / clipping arithmetic as in ``attention_sm90._produce_units``) applied to random plans
  (splits forced) must produce exactly the kv_append result at every position < seq_len,
  write every new token exactly once, and touch no page outside a request's own pages.
* sm_90a compile of every fused variant from fake tensors, PTX greps (wgmma, TMA loads AND
  TMA stores, bulk-group waits, no spills); the default kernel has no TMA store.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.planner import (
    CostModel,
    fresh_mask_units,
    fresh_tile_owned,
    fresh_writeback_items,
    kv_units,
    next_pow2,
    plan,
    worst_case_items,
)

P = 64
CHEAP_SPLIT_MODEL = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                              combine_launch_us=0.0)


def qsl_of(q_lens):
    return np.concatenate([[0], np.cumsum(np.asarray(q_lens, dtype=np.int64))]).astype(np.int32)


def unit_of_position(pos, ctx, page=P):
    """KV unit holding absolute position ``pos`` (independent restatement of the layout)."""
    n_old = -(-ctx // page)
    return pos // page if pos < ctx else n_old + (pos - ctx) // page


def brute_needed_units(qsl, seq_lens, num_kv_heads, page=P):
    """need[b, h, t, u]: new token t of request b reads some key position of unit u."""
    qsl = np.asarray(qsl, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    q = np.diff(qsl)
    max_q = max(1, int(q.max(initial=0)))
    max_u = max(1, int(sl.max(initial=0)) // page + 2)
    need = np.zeros((sl.shape[0], num_kv_heads, max_q, max_u), dtype=bool)
    for b in range(sl.shape[0]):
        L, ql = int(sl[b]), int(q[b])
        if ql == 0 or L == 0:
            continue
        ctx = L - ql
        for t in range(ql):
            for pos in range(ctx + t + 1):  # causal: keys 0 ..= own position
                need[b, :, t, unit_of_position(pos, ctx, page)] = True
    return need


def check_fresh_plan(p, qsl, seq_lens, *, num_kv_heads, group_size, tile_m=64):
    assert p.fresh_kv
    tpt = tile_m // next_pow2(group_size)
    qsl = np.asarray(qsl, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    q = np.diff(qsl)
    need = brute_needed_units(qsl, sl, num_kv_heads)
    count = np.zeros(need.shape, dtype=np.int32)
    groups = {}
    for i, row in enumerate(p.work.tolist()):
        b, h, t0, nt, u0, u1, s, ns, _qh = row
        assert q[b] > 0 and sl[b] > 0, f"item {i}: phantom request"
        assert 1 <= nt <= tpt and t0 % tpt == 0 and t0 + nt <= q[b], f"item {i}: tokens"
        assert 0 <= u0 < u1, f"item {i}: empty unit range"
        ctx = sl[b] - q[b]
        # the tile needs old pages + fresh tiles up to its last token's, no more
        assert u1 <= -(-ctx // P) + (t0 + nt - 1) // P + 1, f"item {i}: phantom fresh tile"
        assert need[b, h, t0:t0 + nt, u0:u1].any(axis=0).all(), f"item {i}: unneeded unit"
        count[b, h, t0:t0 + nt, u0:u1] += need[b, h, t0:t0 + nt, u0:u1]
        groups.setdefault((b, h, t0), []).append((s, ns, u0, u1))
    bad = np.argwhere(count != need.astype(np.int32))
    assert bad.size == 0, f"unit coverage mismatch at (b,h,t,unit)={bad[0].tolist()}"
    for key, items in groups.items():
        items.sort()
        ns = items[0][1]
        assert [it[0] for it in items] == list(range(ns)) and all(it[1] == ns for it in items)
        assert items[0][2] == 0 and all(items[k][3] == items[k + 1][2] for k in range(ns - 1))
    return groups


def random_batch(rng, n_max=7, heavy=False):
    n = int(rng.integers(1, n_max + 1))
    q_lens, seq_lens = [], []
    for _ in range(n):
        kind = rng.integers(0, 5)
        if kind == 0:  # decode
            ql = 1
            sl = int(rng.integers(1, 700 if heavy else 300))
        elif kind == 1:  # prefill chunk with ctx not a multiple of 64
            ql = int(rng.integers(2, 200))
            sl = ql + int(rng.integers(1, 300))
        elif kind == 2:  # fresh prefill
            ql = int(rng.integers(1, 200))
            sl = ql
        elif kind == 3:  # no new token / empty
            ql = 0
            sl = int(rng.integers(0, 200))
        else:  # page-boundary lengths
            sl = P * int(rng.integers(1, 5)) + int(rng.integers(-1, 2))
            ql = int(min(sl, rng.choice([1, 63, 64, 65, 129])))
        q_lens.append(ql)
        seq_lens.append(sl)
    return q_lens, seq_lens


# ------------------------------------------------------------------------------ planner


def test_kv_units_formula():
    # ctx = 100 -> 2 old pages; new tokens 0..63 -> fresh tile 0, 64 -> tile 1
    assert kv_units(100, 0) == 3 and kv_units(100, 63) == 3 and kv_units(100, 64) == 4
    assert kv_units(0, 0) == 1 and kv_units(128, 127) == 4


@pytest.mark.parametrize("group_size", [1, 2, 5, 8])
def test_fresh_plan_covers_every_needed_unit_once(group_size):
    rng = np.random.default_rng(group_size)
    for _ in range(12):
        q_lens, seq_lens = random_batch(rng)
        qsl = qsl_of(q_lens)
        for cm, nc in ((None, 132), (CHEAP_SPLIT_MODEL, 64)):
            p = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=2,
                     group_size=group_size, num_ctas=nc, cost_model=cm, fresh_kv=True)
            check_fresh_plan(p, qsl, seq_lens, num_kv_heads=2, group_size=group_size)


def test_decode_rows_get_old_pages_plus_one_fresh_tile():
    seq_lens = [1, 2, 64, 65, 128, 129, 1000]
    p = plan(qsl_of([1] * len(seq_lens)), np.asarray(seq_lens, np.int32), num_kv_heads=1,
             group_size=4, allow_split=False, fresh_kv=True)
    got = {int(r[0]): int(r[5] - r[4]) for r in p.work}
    assert got == {b: -(-(L - 1) // P) + 1 for b, L in enumerate(seq_lens)}


def test_causal_pruning_of_fresh_tiles():
    # 200 new tokens after 30 cached: 1 old page; q tiles (Gp=1) need fresh tiles 0..t//64
    p = plan(qsl_of([200]), np.asarray([230], np.int32), num_kv_heads=1, group_size=1,
             allow_split=False, fresh_kv=True)
    got = sorted((int(r[2]), int(r[4]), int(r[5])) for r in p.work)
    assert got == [(0, 0, 2), (64, 0, 3), (128, 0, 4), (192, 0, 5)]
    # the paged plan of the same batch reads pages 0..(30+t)//64 instead
    q = plan(qsl_of([200]), np.asarray([230], np.int32), num_kv_heads=1, group_size=1,
             allow_split=False)
    assert sorted((int(r[2]), int(r[5])) for r in q.work) == [(0, 2), (64, 3), (128, 4), (192, 4)]


def test_fresh_plan_equals_paged_plan_when_ctx_is_page_aligned():
    q_lens, seq_lens = [1, 70, 200, 5], [129, 70 + 128, 200, 64 + 5]
    a = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=4,
             fresh_kv=True)
    b = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=4)
    assert a.fresh_kv and not b.fresh_kv
    assert np.array_equal(a.work, b.work) and np.array_equal(a.cta_offsets, b.cta_offsets)


def test_fresh_flag_default_and_empty_plan():
    assert not plan(qsl_of([3]), np.asarray([9], np.int32), num_kv_heads=1, group_size=1).fresh_kv
    e = plan(qsl_of([0]), np.asarray([5], np.int32), num_kv_heads=1, group_size=1, fresh_kv=True)
    assert e.n_items == 0 and e.fresh_kv


def test_worst_case_items_bounds_fresh_plans():
    rng = np.random.default_rng(7)
    for _ in range(40):
        q_lens, seq_lens = random_batch(rng, heavy=True)
        g = int(rng.choice([1, 3, 8]))
        ms = int(rng.choice([2, 16]))
        p = plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=g,
                 num_ctas=int(rng.choice([8, 264])), cost_model=CHEAP_SPLIT_MODEL,
                 max_splits=ms, fresh_kv=True)
        bound = worst_case_items(len(q_lens), max(1, sum(q_lens)), max(1, max(seq_lens)),
                                 2, g, max_splits=ms, fresh_kv=True)
        assert p.n_items <= bound
    # the +1 unit matters: 28 cached + 100 new tokens = 2 pages but 3 units for tile 1
    p = plan(qsl_of([100]), np.asarray([128], np.int32), num_kv_heads=1, group_size=1,
             num_ctas=64, cost_model=CHEAP_SPLIT_MODEL, fresh_kv=True)
    assert p.n_items <= worst_case_items(1, 100, 128, 1, 1, fresh_kv=True)
    # tile 0..63 splits over its 2 units, tile 64..99 over its 3
    assert p.n_items == 2 + 3 and sorted(p.work[:, 7].tolist()) == [2, 2, 3, 3, 3]
    assert p.n_items > worst_case_items(1, 100, 128, 1, 1)


# ---------------------------------------------------------------- writeback ownership


def simulate_writeback(p, q_lens, seq_lens, block_table, num_blocks, hkv):
    """numpy model of the kernel's fused writeback: cache[block, h, row] = (b, new token)
    tag of what lands there; -1 = untouched.  Follows attention_sm90._produce_units: the
    owned fresh tile k of (b, h) holds new tokens 64k .. 64k+63 (rows past the request's
    tokens are the next rows of the token stream), store 1 goes to page pos // 64 at row
    offset pos % 64, store 2 (only when valid rows reach past that page) to the next page
    at row offset pos % 64 - 64; rows outside [0, 64) are clipped."""
    qsl = qsl_of(q_lens)
    sl = np.asarray(seq_lens, np.int64)
    cache = np.full((num_blocks, hkv, P), -1, dtype=np.int64)
    writes = np.zeros((num_blocks, hkv, P), dtype=np.int64)
    for item, b, h, k in fresh_writeback_items(p.work, qsl, sl).tolist():
        ql = int(qsl[b + 1] - qsl[b])
        ctx = int(sl[b]) - ql
        tok_rows = int(qsl[b]) + 64 * k + np.arange(P)  # token rows of the smem tile
        pos = ctx + 64 * k
        pg, off = pos // P, pos % P
        stores = [(pg, off)]
        if min(pos + P, int(sl[b])) > (pg + 1) * P:
            stores.append((pg + 1, off - P))
        for page, o in stores:
            assert page < -(-int(sl[b]) // P), "store into a page past the request's last"
            blk = int(block_table[b, page])
            for i in range(P):
                r = o + i
                if 0 <= r < P:
                    cache[blk, h, r] = tok_rows[i]
                    writes[blk, h, r] += 1
    return cache, writes


@pytest.mark.parametrize("seed", range(6))
def test_writeback_owner_is_unique_and_writes_exactly_the_new_tokens(seed):
    rng = np.random.default_rng(100 + seed)
    hkv = 2
    q_lens, seq_lens = random_batch(rng, n_max=8)
    q_lens[0], seq_lens[0] = 300, 300 + int(rng.integers(0, 130))  # long row: splits
    g = int(rng.choice([1, 2, 4, 8]))
    qsl = qsl_of(q_lens)
    p = plan(qsl, np.asarray(seq_lens, np.int32), num_kv_heads=hkv, group_size=g,
             num_ctas=int(rng.choice([16, 264])), cost_model=CHEAP_SPLIT_MODEL,
             max_splits=int(rng.choice([4, 16])), fresh_kv=True)
    check_fresh_plan(p, qsl, seq_lens, num_kv_heads=hkv, group_size=g)
    owners = fresh_writeback_items(p.work, qsl, np.asarray(seq_lens))
    # every fresh tile of every (request, head) with new tokens has exactly one owner
    keys = [tuple(r) for r in owners[:, 1:].tolist()]
    expect = sorted((b, h, k) for b, (ql, L) in enumerate(zip(q_lens, seq_lens))
                    if ql > 0 and L > 0 for h in range(hkv) for k in range(-(-ql // P)))
    assert sorted(keys) == expect and len(set(keys)) == len(keys)
    # the owner processes the unit and its q tile holds the tile's last (or last new) token
    for item, b, h, k in owners.tolist():
        _, _, t0, nt, u0, u1, _, _, _ = p.work[item].tolist()
        n_old = -(-(seq_lens[b] - q_lens[b]) // P)
        assert u0 <= n_old + k < u1
        assert t0 <= min(64 * k + 63, q_lens[b] - 1) < t0 + nt
    # modeled TMA stores: each position < seq_len of each request written once, with the
    # token that kv_append (block-table slot mapping) writes there; nothing outside
    pages = [-(-L // P) for L in seq_lens]
    nblk = sum(pages) + 3
    perm = rng.permutation(nblk)
    bt = np.full((len(q_lens), max(pages) + 2), nblk - 1, dtype=np.int64)  # garbage tail
    at = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[at:at + n]
        at += n
    cache, writes = simulate_writeback(p, q_lens, seq_lens, bt, nblk, hkv)
    owned_blocks = np.zeros(nblk, dtype=bool)
    for b, (ql, L) in enumerate(zip(q_lens, seq_lens)):
        if ql == 0 or L == 0:
            continue
        owned_blocks[bt[b, :pages[b]]] = True
        for pos in range(L):
            blk, row = bt[b, pos // P], pos % P
            if pos >= L - ql:
                assert (cache[blk, :, row] == qsl[b] + pos - (L - ql)).all(), (b, pos)
                assert (writes[blk, :, row] == 1).all()
            else:
                assert (writes[blk, :, row] == 0).all(), f"old token {pos} of {b} overwritten"
    # positions past seq_len (garbage rows) can only be in a request's last page, which
    # the loop above leaves unchecked there; nothing is written twice, no foreign block
    assert writes.max() <= 1, "two stores hit one slot"
    assert not writes[~owned_blocks].any(), "a block no request owns was written"


def test_fresh_tile_owned_is_the_kernel_rule():
    # q_len 150, Gp 4 (16-token tiles): tile 0 -> token 63 -> q tile 48..63; tile 2 ->
    # token 149 -> q tile 144..149
    assert fresh_tile_owned(48, 16, 150, 0) and not fresh_tile_owned(32, 16, 150, 0)
    assert fresh_tile_owned(144, 6, 150, 2) and not fresh_tile_owned(128, 16, 150, 2)
    # decode: the single q tile owns the single fresh tile
    assert fresh_tile_owned(0, 1, 1, 0)


@pytest.mark.parametrize("seed", range(3))
def test_fresh_mask_units_are_exactly_the_units_with_a_masked_key(seed):
    """The fused kernel decides once an item which units run the element-wise mask
    (``fresh_mask_units``: u == u_part or u >= u_diag).  Brute force, key by key: a unit
    holds a masked key iff one of its P keys is invalid for some query of the tile
    (queries at pos0 .. seq_len - 1; an old key is valid iff < ctx, a fresh key iff <= the
    query and < seq_len).  Skipping such a unit would be a wrong answer; masking a unit
    without one costs time."""
    rng = np.random.default_rng(seed)
    for _ in range(400):
        ctx = int(rng.choice([0, 1, 63, 64, 65, 127, 128, int(rng.integers(0, 700))]))
        q_len = int(rng.integers(1, 400))
        seq_len = ctx + q_len
        # the tile's first query: any new token, or past the request (an idle 64-row
        # half of a 128/192-row tile starts after the item's tokens)
        pos0 = ctx + int(rng.integers(0, q_len + 80))
        n_old = -(-ctx // P)
        n_units = n_old + -(-q_len // P)
        u_part, u_diag = fresh_mask_units(ctx, pos0, seq_len, P)
        queries = np.arange(pos0, max(pos0 + 1, seq_len))
        q_max = np.minimum(queries, seq_len - 1)
        for u in range(n_units):
            if u < n_old:
                keys = u * P + np.arange(P)
                masked = bool((keys >= ctx).any())
            else:
                keys = ctx + (u - n_old) * P + np.arange(P)
                masked = bool((keys[None, :] > q_max[:, None]).any())
            assert (u == u_part or u >= u_diag) == masked, (ctx, q_len, pos0, u)


# ------------------------------------------------------------------------- API checks


def test_check_new_kv_refuses_bad_key_value():
    from cute_kernels.attention import check_new_kv

    q = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(3, 2, 64, 128, dtype=torch.bfloat16)
    key = torch.zeros(5, 2, 128, dtype=torch.bfloat16)
    check_new_kv(q, key, key.clone(), kc)  # fine
    check_new_kv(q, None, None, kc)
    with pytest.raises(ValueError, match="both key and value"):
        check_new_kv(q, key, None, kc)
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        check_new_kv(q, key[:4], key[:4], kc)
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        check_new_kv(q, key[:, :1], key[:, :1], kc)
    with pytest.raises(TypeError, match="dtype"):
        check_new_kv(q, key.half(), key.half(), kc)
    base = torch.zeros(5, 2 * 128 + 4, dtype=torch.bfloat16)
    odd = base[:, 4:].unflatten(1, (2, 128))  # 8-byte offset, 520-byte token stride
    with pytest.raises(ValueError, match="16 bytes|16-byte"):
        check_new_kv(q, odd, odd, kc)


def test_device_plan_records_the_plan_kind():
    from cute_kernels.attention import DevicePlan

    qsl, sl = qsl_of([1, 70]), np.asarray([65, 100], np.int32)
    pf = plan(qsl, sl, num_kv_heads=2, group_size=4, num_ctas=8, fresh_kv=True)
    pp = plan(qsl, sl, num_kv_heads=2, group_size=4, num_ctas=8)
    dp = DevicePlan(item_capacity=64, group_capacity=8, partial_rows_capacity=64, num_ctas=8,
                    head_dim=128, device="cpu")
    assert dp.fresh_kv is None
    assert dp.upload(pf).fresh_kv is True
    np.testing.assert_array_equal(dp.work[:pf.n_items].numpy(), pf.work[:, :8])
    assert dp.upload(pp).fresh_kv is False


# ----------------------------------------------------------------------- sm_90a compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402


def _vid(v):
    return "-".join(str(x) for x in v)


def _nvdisasm():
    import glob
    import os
    import shutil
    import sys

    found = shutil.which("nvdisasm")
    if found:
        return found
    for sp in sys.path:
        hits = glob.glob(os.path.join(sp, "nvidia", "cu*", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def _sass(cubin: bytes):
    """SASS text of a cubin (None when no nvdisasm is installed)."""
    import subprocess
    import tempfile

    tool = _nvdisasm()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def _tma(art):
    ops = art.instructions("cp.async.bulk.tensor")
    loads = [o for o in ops if ".shared::cluster.global" in o or ".shared::cta.global" in o]
    stores = [o for o in ops if ".global.shared::cta" in o]
    return loads, stores


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_vid(v) for v in ALL_VARIANTS])
def test_fused_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_fused_kernel(variant), *attention.fused_fake_args(variant),
                        compile_options="--enable-tvm-ffi", keep_cubin=True)
    assert art.has("wgmma.mma_async") and art.has("setmaxnreg") and art.has("mbarrier.try_wait")
    loads, stores = _tma(art)
    assert loads, "K/V/Q tiles by TMA load"
    assert stores, "the fresh K/V tiles must be written back by TMA store"
    assert art.has("cp.async.bulk.commit_group")
    assert art.has("cp.async.bulk.wait_group.read"), "stage reuse waits for the store's smem read"
    assert art.count(r"cp\.async\.bulk\.wait_group\s+0;") >= 1, "all stores done before exit"
    # K and V: one TMA store each (into the tile's first page, non-negative row offset),
    # one per 64-column chunk of D.  The rows reaching into the next page are copied with
    # plain stores: a TMA store there would need a negative row coordinate, which the H200
    # rejected with cudaErrorIllegalInstruction.
    n_stores = art.count(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta")
    assert n_stores == 2 * (variant.head_dim // 64)
    assert art.count(r"st\.global\.b16") >= 2, "straddle rows (K and V) by plain stores"
    assert not art.has("st.local"), "register spill to local memory"
    sass = _sass(art.cubin)
    if sass is not None:  # ptxas' own spills (e.g. past the producer's setmaxnreg budget)
        assert "UTMASTG" in sass and "HGMMA" in sass
        assert "STL" not in sass and "LDL" not in sass, "ptxas spilled registers"


def test_default_kernel_has_no_tma_store():
    v = ALL_VARIANTS[-1]
    art = compile_sm90a(attention.make_kernel(v), *attention.fake_args(v),
                        compile_options="--enable-tvm-ffi", keep_cubin=True)
    loads, stores = _tma(art)
    assert loads and not stores
    assert not art.has("cp.async.bulk.commit_group")
    sass = _sass(art.cubin)
    if sass is not None:
        assert "UTMALDG" in sass and "UTMASTG" not in sass


@pytest.mark.parametrize("vi,unpacked,consumers,kv_pair", [
    (7, False, 1, False), (1, True, 1, False), (7, True, 2, False), (7, True, 3, False),
    (1, True, 3, False), (7, True, 2, True), (0, False, 1, False), (9, True, 2, False),
    (3, True, 2, True)],
    ids=["bf16-128-8-m64", "bf16-64-2-unpacked", "bf16-128-8-m128", "bf16-128-8-m192",
         "bf16-64-2-m192", "bf16-128-8-pairs", "bf16-64-1-m64", "f16-64-2-m128",
         "bf16-64-8-pairs"])
def test_vec_straddle_variants_copy_16_bytes_a_lane(vi, unpacked, consumers, kv_pair):
    """``vec_straddle=True``: the straddle copy (K and V) is 128-bit shared loads and global
    stores, with no element-wise ones left, the TMA writeback unchanged and no spills; with
    False the kernel is the element-wise one (``st.global.b16``, ``ld.shared.b16``).  At
    D = 64 the 16-byte kernels give the producer 48 registers (it spills at 40) and the
    consumers 8 fewer, with the same steady state (MUFU.EX2 count) as the element-wise
    kernel's."""
    v = ALL_VARIANTS[vi]
    arts, kern = {}, {}
    for vs in (False, True):
        fn = attention.make_fused_kernel(v, unpacked, consumers=consumers, kv_pair=kv_pair,
                                         vec_straddle=vs)
        kern[vs] = fn.__self__
        assert kern[vs].vec_straddle is vs
        arts[vs] = compile_sm90a(fn, *attention.fused_fake_args(v, unpacked),
                                 compile_options="--enable-tvm-ffi", keep_cubin=True)
    plain, vec = arts[False], arts[True]
    if v.head_dim == 64:
        assert (kern[False].producer_regs, kern[True].producer_regs) == (40, 48)
        assert kern[True].consumer_regs == {1: 208, 2: 224, 3: 144}[consumers]
        k = kern[True]  # the register budget fits: setmaxnreg never waits for registers
        entry = {1: 128, 2: 168, 3: 128}[consumers] * k.threads
        assert 128 * k.producer_regs + 128 * consumers * k.consumer_regs <= entry
    else:
        assert kern[True].producer_regs == kern[False].producer_regs
        assert kern[True].consumer_regs == kern[False].consumer_regs
    assert plain.count(r"st\.global\.b16") >= 2 and plain.has("ld.shared.b16")
    assert not vec.has("st.global.b16") and not vec.has("ld.shared.b16")
    assert vec.count(r"st\.global\.v4\.b32") >= 2, "K and V straddle rows, 16 bytes a lane"
    assert vec.count(r"ld\.shared\.v4\.b32") >= 2
    for art in (plain, vec):
        n_stores = art.count(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta")
        assert n_stores == 2 * (v.head_dim // 64) * (2 if kv_pair else 1)
        assert not art.has("st.local")
    sass = _sass(vec.cubin)
    if sass is not None:
        assert "STG.E.128" in sass and "LDS.128" in sass and "STG.E.U16" not in sass
        assert "STL" not in sass and "LDL" not in sass, "ptxas spilled registers"
        assert sass.count("MUFU.EX2") == _sass(plain.cubin).count("MUFU.EX2")
    # the plain kernel (no fresh_kv) has no straddle copy at all: the flag is dropped
    from cute_kernels.attention_sm90 import IonAttentionSm90
    import cutlass
    assert not IonAttentionSm90(cutlass.BFloat16, 128, 8, vec_straddle=True).vec_straddle
