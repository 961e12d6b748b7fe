"""CPU tests of page pairs (``IonAttentionSm90(consumers=2, kv_pair=True)``: a K/V stage
holds two consecutive 64-token pages of an item, so S = Q K^T covers 128 keys).

* Key coverage, on real ``tile_m=128`` plans: emulating what the kernel loads (pages
  ``p, p + 1`` of an item into the two halves of a stage; an odd last page into both) and
  what its mask keeps (key ``<= min(query position, min(seq_len, p1 * P) - 1)``), every
  query row of every item sees each causal key of its page range exactly once, never the
  duplicate half, never a key of another split.  Dropping the item-end limit from the mask
  fails this check (the duplicate half would be counted twice).
* sm_90a compile from fake tensors: QK^T as m64n128k16 wgmma, two K and two V TMA load
  sites per stage, 384 threads, one CTA per SM, the 8-arrival empty barriers, no spill.
* The consumers=2 kernels without pairs are byte-identical (PTX, ``//`` lines aside) to the
  build before ``kv_pair`` existed (pins taken at commit 5f3ec61).
* Fused writeback on pairs (``fresh_kv=True`` plans count KV *units*: cache pages, then
  fresh tiles of the step's new K/V at positions ``ctx + k * P``): the same emulation with
  the kernel's per-half unit mask sees each causal key once, and the stores the producer
  issues (owned fresh tiles, never the copy in an odd last stage) write every fresh tile
  of every (request, KV head) exactly once.
* Refusals: pairs on the 64-row kernels and on other pages; plans.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from cute_kernels.planner import CostModel, plan

P = 64
CHEAP_SPLIT_MODEL = CostModel(item_overhead_us=0.01, split_item_overhead_us=0.0,
                              combine_launch_us=0.0)


def _qsl(q_lens):
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def _seen_keys(row, seq_len, q_len, gp, *, limit_to_item=True):
    """(token, key position) pairs the pair kernel keeps for one item: the producer's loads
    (page table indirection replaced by the page index; an odd last page into both halves)
    and the consumer's mask, both written as the kernel does them."""
    b, h, t0, nt, p0, p1, s, ns, qh = row
    tpt = 128 // gp if qh < 0 else 128
    seen = []
    for p in range(p0, p1, 2):
        halves = (p, p + 1 if p + 1 < p1 else p)  # the pages the two halves hold
        kv0 = p * P
        lim = (min(seq_len, p1 * P) if limit_to_item else seq_len) - 1
        for t in range(t0, t0 + nt):
            assert t - t0 < tpt
            qpos = seq_len - q_len + t
            for c in range(2 * P):
                kv = kv0 + c  # the mask's key position of column c
                if kv > min(qpos, lim):
                    continue
                page = halves[c // P]
                seen.append((t, page * P + c % P))  # the key actually in that column
    return seen


def _check_pairs(q_lens, seq_lens, *, hkv, g, cost_model=None, unpacked=True,
                 limit_to_item=True):
    p = plan(_qsl(q_lens), np.asarray(seq_lens, dtype=np.int32), num_kv_heads=hkv,
             group_size=g, page_size=P, num_ctas=132, unpacked_prefill=unpacked, tile_m=128,
             **({"cost_model": cost_model} if cost_model else {}))
    gp = 1 << (g - 1).bit_length()
    odd = 0
    per_row = {}
    for row in p.work.tolist():
        b, h, t0, nt, p0, p1, s, ns, qh = row
        odd += (p1 - p0) % 2
        heads = [qh] if qh >= 0 else list(range(g))
        for t, key in _seen_keys(row, seq_lens[b], q_lens[b], gp,
                                 limit_to_item=limit_to_item):
            for hh in heads:
                per_row.setdefault((b, h, hh, t), []).append(key)
    for b, (q, L) in enumerate(zip(q_lens, seq_lens)):
        for h in range(hkv):
            for hh in range(g):
                for t in range(q):
                    want = list(range(0, L - q + t + 1))
                    got = sorted(per_row.get((b, h, hh, t), []))
                    assert got == want, (b, h, hh, t, len(got), len(want))
    return p, odd


def _unit_keys(u, n_old, ctx, seq_len):
    """(first key position, last valid key position) of KV unit u, as the kernel's."""
    if u < n_old:
        return u * P, ctx - 1
    return ctx + (u - n_old) * P, seq_len - 1


def _check_fused_pairs(q_lens, seq_lens, *, hkv, g, cost_model=None):
    from cute_kernels.planner import fresh_tile_owned

    p = plan(_qsl(q_lens), np.asarray(seq_lens, dtype=np.int32), num_kv_heads=hkv,
             group_size=g, page_size=P, num_ctas=132, unpacked_prefill=True, tile_m=128,
             fresh_kv=True, **({"cost_model": cost_model} if cost_model else {}))
    per_row, stores = {}, {}
    odd = 0
    for i, row in enumerate(p.work.tolist()):
        b, h, t0, nt, p0, p1, s, ns, qh = row
        q, L = q_lens[b], seq_lens[b]
        ctx = L - q
        n_old = (ctx + P - 1) // P
        odd += (p1 - p0) % 2
        heads = [qh] if qh >= 0 else list(range(g))
        for u in range(p0, p1, 2):
            units = (u, u + 1 if u + 1 < p1 else u)
            ka, la = _unit_keys(u, n_old, ctx, L)
            kb, lb = _unit_keys(u + 1, n_old, ctx, L)
            if u + 1 >= p1:
                lb = -1
            for t in range(t0, t0 + nt):
                qpos = ctx + t
                for c in range(2 * P):
                    kv, lim = (ka + c, la) if c < P else (kb + c - P, lb)
                    if kv > min(qpos, lim):
                        continue
                    unit = units[c // P]  # what the half holds
                    k0, _ = _unit_keys(unit, n_old, ctx, L)
                    for hh in heads:
                        per_row.setdefault((b, h, hh, t), []).append(k0 + c % P)
            # the producer's stores: an owned fresh unit, never the copy of an odd last unit
            for half, unit in enumerate(units):
                if unit < n_old or (half == 1 and u + 1 >= p1):
                    continue
                kt = unit - n_old
                if fresh_tile_owned(t0, nt, q, kt, P, qh):
                    stores.setdefault((b, h, kt), []).append(i)
    for b, (q, L) in enumerate(zip(q_lens, seq_lens)):
        ctx = L - q
        for h in range(hkv):
            for kt in range((q + P - 1) // P):
                assert len(stores.get((b, h, kt), [])) == 1, (b, h, kt, stores.get((b, h, kt)))
            for hh in range(g):
                for t in range(q):
                    got = sorted(per_row.get((b, h, hh, t), []))
                    assert got == list(range(0, ctx + t + 1)), (b, h, hh, t)
    assert sum(len(v) for v in stores.values()) == len(stores)
    return p, odd


def test_fused_pairs_cover_keys_and_store_every_fresh_tile_once():
    rng = np.random.default_rng(5)
    odd_total = 0
    for trial in range(6):
        n = int(rng.integers(2, 6))
        q_lens = [int(x) for x in rng.choice([1, 1, 3, 70, 129, 300], size=n)]
        seq_lens = [q + int(rng.choice([0, 1, 37, 64, 100, 700])) for q in q_lens]
        _, odd = _check_fused_pairs(q_lens, seq_lens, hkv=2, g=7,
                                    cost_model=CHEAP_SPLIT_MODEL if trial % 2 else None)
        odd_total += odd
    assert odd_total > 0


@pytest.mark.parametrize("g", [7, 8, 1])
def test_pairs_cover_every_causal_key_once(g):
    rng = np.random.default_rng(g)
    for trial in range(4):
        n = int(rng.integers(2, 6))
        q_lens = [int(x) for x in rng.choice([1, 1, 3, 70, 129, 300], size=n)]
        seq_lens = [q + int(rng.choice([0, 1, 37, 64, 100, 700])) for q in q_lens]
        split = CHEAP_SPLIT_MODEL if trial % 2 else None
        _check_pairs(q_lens, seq_lens, hkv=2, g=g, cost_model=split)


def test_odd_page_counts_and_splits_are_exercised():
    # decode rows of 3, 5 and 9 pages, a chunk whose context is not a page multiple, forced
    # splits (split items with odd page counts: the duplicate-half path)
    p, odd = _check_pairs([1, 1, 1, 100, 1], [150, 300, 560, 100 + 37, 3000], hkv=2, g=7,
                          cost_model=CHEAP_SPLIT_MODEL)
    assert odd > 0 and (p.work[:, 7] > 1).any()


def test_the_item_end_limit_is_what_drops_the_duplicate():
    with pytest.raises(AssertionError):
        _check_pairs([1, 1], [150, 3000], hkv=1, g=7, cost_model=CHEAP_SPLIT_MODEL,
                     limit_to_item=False)


# --------------------------------------------------------------------------- compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402


def _loads(ptx):
    return len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::c\w+\.global", ptx))


@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_pair_variant_compiles_for_sm90a(vi, unpacked):
    from test_two_consumers_cpu import _barrier_init_counts, _check_no_spills

    v = ALL_VARIANTS[vi]
    art = compile_sm90a(attention.make_kernel(v, unpacked, consumers=2, kv_pair=True),
                        *attention.fake_args(v, unpacked), compile_options="--enable-tvm-ffi",
                        keep_cubin=True)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", art.ptx))
    # QK^T over 128 keys; PV over D columns
    assert shapes == {"m64n128k16", f"m64n{v.head_dim}k16"}
    assert art.has("cp.async.bulk.tensor")
    assert art.has("setmaxnreg.inc.sync.aligned.u32 \t240;")
    assert ".reqntid 384, 1, 1" in art.ptx and ".minnctapersm 1" in art.ptx
    assert _barrier_init_counts(art.ptx) == [1] * 6 + [8] * 6
    _check_no_spills(art)
    plain = compile_sm90a(attention.make_kernel(v, unpacked, consumers=2),
                          *attention.fake_args(v, unpacked), compile_options="--enable-tvm-ffi")
    # one more K and one more V load site (the second page of a stage) per 64 columns of D
    assert _loads(art.ptx) == _loads(plain.ptx) + 2 * (v.head_dim // 64)
    assert "m64n128k16" not in plain.ptx or v.head_dim == 128


@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_fused_pair_variant_compiles_for_sm90a(vi):
    from test_two_consumers_cpu import _barrier_init_counts, _check_no_spills

    v = ALL_VARIANTS[vi]
    art = compile_sm90a(attention.make_fused_kernel(v, True, consumers=2, kv_pair=True),
                        *attention.fused_fake_args(v, True), compile_options="--enable-tvm-ffi",
                        keep_cubin=True)
    assert "m64n128k16" in art.ptx
    assert art.has("setmaxnreg.dec.sync.aligned.u32 \t40;")
    assert art.has("setmaxnreg.inc.sync.aligned.u32 \t232;")
    assert _barrier_init_counts(art.ptx) == [1] * 6 + [8] * 6
    _check_no_spills(art)
    plain = compile_sm90a(attention.make_fused_kernel(v, True, consumers=2),
                          *attention.fused_fake_args(v, True), compile_options="--enable-tvm-ffi")
    # each K/V load site (cache page, fresh tile) and each writeback store site once per half
    stores = r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta"
    assert len(re.findall(stores, art.ptx)) == 2 * len(re.findall(stores, plain.ptx))
    assert _loads(art.ptx) > _loads(plain.ptx)
    assert art.count(r"st\.global\.b16") >= 2, "straddle rows by plain stores"


# consumers=2 PTX at commit 5f3ec61 (before kv_pair), `//` lines and the PDL trigger dropped
# unpacked pins re-taken on 2026-12-03 (v18: the chunked partial store of split unpacked
# items, GPU-validated); the plain pins are unchanged; the fused pin re-taken on 2026-12-03
# (nineteenth session: the fused kernels' loop-invariant mask decision, GPU-validated)
_PINNED_C2 = [
    (1, "plain", "d289485e9409d5ab"), (1, "unpacked", "b99fefce2413a5c5"),
    (7, "plain", "080067091f9dc541"), (7, "unpacked", "af96c199af3710f3"),
    (12, "unpacked", "2497ce387a137f80"), (7, "fused-unpacked", "77ea083802161a04"),
]


@pytest.mark.parametrize("vi,kind,sha", _PINNED_C2, ids=[f"{a}-{b}" for a, b, _ in _PINNED_C2])
def test_two_consumer_ptx_unchanged_by_pairs(vi, kind, sha):
    from test_two_consumers_cpu import _ptx_sha

    v = ALL_VARIANTS[vi]
    u = "unpacked" in kind
    # the pins are of the 2-stage kernels (the default depth until 2026-12-02)
    if kind.startswith("fused"):
        art = compile_sm90a(attention.make_fused_kernel(v, u, consumers=2, kv_stages=2),
                            *attention.fused_fake_args(v, u), compile_options="--enable-tvm-ffi")
    else:
        art = compile_sm90a(attention.make_kernel(v, u, consumers=2, kv_stages=2),
                            *attention.fake_args(v, u), compile_options="--enable-tvm-ffi")
    assert _ptx_sha(art.ptx) == sha


def test_pairs_are_refused_where_not_implemented():
    from cute_kernels.attention_sm90 import IonAttentionSm90

    with pytest.raises(ValueError, match="consumers=2"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, kv_pair=True)
    with pytest.raises(ValueError, match="consumers=2"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, fresh_kv=True, kv_pair=True)
    with pytest.raises(ValueError, match="page_size"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, page_size=128, consumers=2, kv_pair=True)
    k = IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=2, kv_pair=True)
    assert (k.kv_tile, k.pages_per_tile, k.kv_stages) == (128, 2, 2)
    with pytest.raises(ValueError, match="consumers=2"):
        attention.make_kernel(ALL_VARIANTS[7], kv_pair=True)
    with pytest.raises(ValueError, match="consumers=2"):
        attention.make_fused_kernel(ALL_VARIANTS[7], kv_pair=True)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.DevicePlan(item_capacity=1, group_capacity=1, partial_rows_capacity=0,
                             num_ctas=4, head_dim=128, device="cpu", kv_pair=True)
    dp = attention.make_device_plan(np.array([0, 300], np.int32), np.array([300], np.int32),
                                    num_kv_heads=4, group_size=7, page_size=P, head_dim=128,
                                    device="cpu", tile_m=128, unpacked_prefill=True,
                                    kv_pair=True)
    assert dp.kv_pair and dp.tile_m == 128


def compile_key(kind: str, key: tuple) -> tuple:
    """(kind, unpacked, consumers, lazy, kv_pair, kv_stages, pingpong, pin_pv_wait) of a
    compiled-kernel cache key (``key[0]`` the variant), then the seventeenth session's
    options (``_compiled``: skip_idle; ``_compiled_fused``: vec_straddle, skip_idle) only
    when one of them is set, so the tests of the older options read as before."""
    base, extra = key[1:8], key[8:]
    return (kind,) + base + (extra if any(extra) else ())


def default_fused_tail() -> tuple:
    """What ``compile_key`` appends to a fused kernel's key when a plan leaves vec_straddle
    at its default and skip_idle off: (True, False) while ``VEC_STRADDLE_DEFAULT`` is True
    (the nineteenth session's default), nothing when it is False."""
    return (True, False) if attention.VEC_STRADDLE_DEFAULT else ()


def record_precompile(monkeypatch) -> list:
    """Stub out every compile ``attention.precompile`` triggers; the returned list collects
    ``compile_key`` of each attention kernel it asks for (kind "attn" or "fused")."""
    from cute_kernels import append_sm90

    calls = []
    monkeypatch.setattr(attention, "_compiled",
                        lambda *a: calls.append(compile_key("attn", a)))
    monkeypatch.setattr(attention, "_compiled_fused",
                        lambda *a: calls.append(compile_key("fused", a)))
    monkeypatch.setattr(attention, "_compiled_combine", lambda *a: None)
    monkeypatch.setattr(append_sm90, "_compiled_kernel", lambda *a: None)
    return calls


def stub_launch_kernels(monkeypatch) -> list:
    """Stub out the compiled attention kernels and ``check_inputs`` (inputs of 300 tokens,
    28 q / 4 KV heads, d 128, 64-token pages) so that ``ion_attention`` runs on the CPU;
    the returned list collects the ``compile_key`` of every kernel a launch asks for."""
    seen = []

    def fake(kind):
        def get(*key):
            seen.append(compile_key(kind, key))
            return lambda *a: None
        return get

    monkeypatch.setattr(attention, "_compiled", fake("attn"))
    monkeypatch.setattr(attention, "_compiled_fused", fake("fused"))
    monkeypatch.setattr(attention, "check_inputs", lambda *a: (300, 28, 4, 128, 64))
    return seen


def record_launches(monkeypatch, tile_ms=(128,), **plan_options):
    """Stub out the compiled kernels, then plan one 300-token prefill (28 q / 4 KV heads,
    d 128) for every tile size in ``tile_ms`` with ``plan_options``, and launch it with and
    without key/value.  Returns (the plans, the ``compile_key`` of every kernel the
    launches asked for)."""
    import torch

    seen = stub_launch_kernels(monkeypatch)
    qsl, sl = np.array([0, 300], np.int32), np.array([300], np.int32)
    plans = []
    for tile_m in tile_ms:
        for fresh in (False, True):
            dp = attention.make_device_plan(qsl, sl, num_kv_heads=4, group_size=7,
                                            page_size=64, head_dim=128, device="cpu",
                                            tile_m=tile_m, fresh_kv=fresh, **plan_options)
            q = torch.zeros(300, 28, 128, dtype=torch.bfloat16)
            kv = torch.zeros(300, 4, 128, dtype=torch.bfloat16) if fresh else None
            attention.ion_attention(q, None, None, q, None, None, None, 0.1, plan=dp, key=kv,
                                    value=kv)
            plans.append(dp)
    return plans, seen


def record_bench_plans(monkeypatch):
    """Stub out what the kernel bench's ION backends need besides their plan; returns (the
    plan options every backend asked for, a lone 8192 prefill (128-row tiles), a mixed
    step (64-row tiles), the options ``ion-auto`` plans on both)."""
    import torch

    from ion_vllm.bench import kernel_runner as kr
    from ion_vllm.bench.kernel_suite import Case

    seen = []
    monkeypatch.setattr(kr, "_ion_plan", lambda case, device, **opts: seen.append(opts))
    monkeypatch.setattr(kr, "ion_cache", lambda case, rot, device: (torch.zeros(1, 4, 64),) * 4)
    monkeypatch.setattr(kr, "_common_meta", lambda case, device: (None, None))
    monkeypatch.setattr(kr, "new_token_rows", lambda case, rot, device: (None, None, None))
    prefill = Case("p", q_lens=(8192,), kv_lens=(8192,))
    mixed = Case("m", q_lens=(1,) * 32 + (2048,), kv_lens=(8192,) * 32 + (2048,))
    auto = {"unpacked_prefill": True, "row_combine": True, "lane_combine": True}
    return seen, prefill, mixed, auto


def test_precompile_builds_only_the_kernels_the_plans_launch(monkeypatch):
    """With kv_pair, every 128-row kernel precompiled is a page-pair one (the backend's
    128-row plans all carry kv_pair) and no 64-row one is; without it, none is."""
    import torch

    calls = record_precompile(monkeypatch)
    for kv_pair in (True, False):
        calls.clear()
        attention.precompile(torch.bfloat16, 128, 28, 4, 64, fused=True, unpacked=True,
                             consumers=(1, 2), lane_combine=True, kv_pair=kv_pair)
        # (kind, unpacked, consumers, lazy, kv_pair, kv_stages, pingpong, pin_pv_wait); the
        # fused kernels with the 16-byte straddle copy (+ vec_straddle, skip_idle), the
        # default
        base = [(kind, u, c, False, kv_pair and c == 2, None, None, None)
                for kind in ("attn", "fused") for u in (False, True) for c in (1, 2)]
        assert sorted(calls) == sorted(k + (True, False) if k[0] == "fused" else k
                                       for k in base)


def test_launch_and_precompile_carry_vec_straddle_and_skip_idle(monkeypatch):
    """The seventeenth session's options reach the compiled-kernel cache: vec_straddle only
    the fused kernels, skip_idle only the 128/192-row ones (a 64-row plan keeps the one
    default compile)."""
    import torch

    _, seen = record_launches(monkeypatch, tile_ms=(64, 192), unpacked_prefill=True,
                              vec_straddle=True, skip_idle=True)
    assert seen == [("attn", True, 1, False, False, None, None, None),
                    ("fused", True, 1, False, False, None, None, None, True, False),
                    ("attn", True, 3, False, False, None, None, None, True),
                    ("fused", True, 3, False, False, None, None, None, True, True)]
    calls = record_precompile(monkeypatch)
    attention.precompile(torch.bfloat16, 128, 28, 4, 64, fused=True, unpacked=False,
                         consumers=(1, 3), vec_straddle=True, skip_idle=True)
    assert calls == [("attn", False, 1, False, False, None, None, None),
                     ("fused", False, 1, False, False, None, None, None, True, False),
                     ("attn", False, 3, False, False, None, None, None, True),
                     ("fused", False, 3, False, False, None, None, None, True, True)]
    # the default (True) compiles each fused kernel with the 16-byte copy, "auto" both
    # copies, False only the element-wise one; at head size 64 every mode is False (not in
    # VEC_STRADDLE_HEAD_DIMS until its 16-byte kernels have run on a GPU)
    for vs, d, want in ((None, 128, [True]), ("auto", 128, [False, True]),
                        (False, 128, [False]), ("auto", 64, [False]), (None, 64, [False])):
        calls.clear()
        kw = {} if vs is None else {"vec_straddle": vs}
        attention.precompile(torch.bfloat16, d, 28, 4, 64, fused=True, consumers=(1,), **kw)
        assert [k[8] if len(k) > 8 else False for k in calls if k[0] == "fused"] == want


def test_auto_vec_straddle_follows_each_uploaded_plan(monkeypatch):
    """DevicePlan(vec_straddle="auto"): a fused launch runs the 16-byte straddle kernels
    exactly for the plans with a straddling fresh tile (a chunk continuing at a context
    that is not a page multiple), element-wise ones for the others; True / False pin it;
    the plain (attention-only) kernels have no such copy and never change."""
    import torch

    from cute_kernels import planner

    seen = stub_launch_kernels(monkeypatch)
    # decode rows here are long enough to split: their combine must not run either
    monkeypatch.setattr(attention, "_compiled_combine", lambda *a: (lambda *b: None))
    steps = [  # (query_start_loc, seq_lens, straddles)
        ([0, 300], [300], False),                  # fresh prompt: ctx 0
        ([0, 300], [300 + 1023], True),            # continuing at ctx 1023
        ([0, 1, 301], [5000, 300 + 1024], False),  # decode + chunk at a page multiple
        ([0, 1, 2], [5001, 77], False),            # decodes only
        ([0, 20, 21], [20 + 1000, 99], False),     # chunk ends inside ctx's page
        ([0, 100, 101], [100 + 1000, 99], True),   # ...and one that runs past it
    ]
    q = torch.zeros(300, 28, 128, dtype=torch.bfloat16)
    kv = torch.zeros(300, 4, 128, dtype=torch.bfloat16)
    for mode in ("auto", True, False):
        dp = attention.DevicePlan(item_capacity=4096, group_capacity=4096,
                                  partial_rows_capacity=1 << 16, num_ctas=132,
                                  head_dim=128, device="cpu", vec_straddle=mode)
        for qsl, sl, straddles in steps:
            hp = planner.plan(np.array(qsl, np.int32), np.array(sl, np.int32),
                              num_kv_heads=4, group_size=7, num_ctas=132, fresh_kv=True)
            assert hp.straddles is straddles
            assert planner.fresh_tiles_straddle(qsl, sl) is straddles
            seen.clear()
            attention.ion_attention(q, None, None, q, None, None, None, 0.1,
                                    plan=dp.upload(hp), key=kv, value=kv)
            want = straddles if mode == "auto" else mode
            assert seen == [("fused", False, 1, False, False, None, None, None)
                            + ((True, False) if want else ())], (mode, qsl, sl)
        # an attention-only plan never straddles (its kernels read new K/V from the cache)
        assert not planner.plan(np.array([0, 300], np.int32), np.array([1323], np.int32),
                                num_kv_heads=4, group_size=7).straddles
    # head size 64 plans run the element-wise copy ("auto" and True alike) while 64 is not
    # in VEC_STRADDLE_HEAD_DIMS; with it they run the 16-byte kernels as at 128
    assert attention.VEC_STRADDLE_HEAD_DIMS == frozenset({128})
    assert attention.check_vec_straddle("auto", 64) is False
    assert attention.check_vec_straddle(True, 64) is False
    monkeypatch.setattr(attention, "VEC_STRADDLE_HEAD_DIMS", frozenset({64, 128}))
    assert attention.check_vec_straddle("auto", 64) == "auto"
    assert attention.check_vec_straddle(True, 64) is True
    monkeypatch.undo()
    with pytest.raises(ValueError, match="vec_straddle"):
        attention.check_vec_straddle("yes", 128)
