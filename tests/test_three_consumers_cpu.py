"""CPU tests of the three-consumer-warpgroup kernel (``IonAttentionSm90(consumers=3)``: 192-row
q tiles, warpgroup 0 = TMA producer, warpgroups 1-3 = consumers of rows 0-63 / 64-127 /
128-191 sharing every K/V stage; one 512-thread CTA per SM; v17, an experiment) and of
``tile_m=192`` plans.

* Planner with ``tile_m=192``: the independent checker of ``test_two_consumers_cpu``
  (every (request, q head, new token, KV page) exactly once, no phantom page, split-KV
  partial rows as the combine reads them) on random batches; ``worst_case_items`` bounds
  them; one 8192-token prefill gets ceil(8192 / 192) unpacked tiles per q head.
* ``DevicePlan`` / ``make_device_plan`` record ``tile_m=192`` and 3 consumers, and refuse
  the options that only the 128-row kernels have (page pairs, ping-pong).
* sm_90a compile from fake tensors (plain, unpacked, fused, fused unpacked; D 64/128;
  bf16/fp16): wgmma, TMA, 512 threads, one CTA per SM, setmaxnreg 24/144 (fused 40/144),
  at D = 128 the steady state's 34 exp2 a page (with 152-160 registers ptxas rematerialized
  them in some variants: 66), no local memory in the PTX and no spill
  in the SASS; the Q/K/V *empty* barriers count 12 arrivals (the 4 warps of each of the 3
  consumers), the full ones 1; shared memory (4 K/V stages, 2 Q stages of three boxes)
  fits the SM's 227 KiB.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from cute_kernels.planner import W_QHEAD, plan, worst_case_items
from test_two_consumers_cpu import CHEAP_SPLIT_MODEL, check_plan_128, qsl_of, random_batch

TM3 = 192


@pytest.mark.parametrize("g", [1, 3, 7, 8])
def test_tile_m_192_plan_covers_every_triple_once(g):
    rng = np.random.default_rng(70 + g)
    got_split = got_unpacked = 0
    for trial in range(8):
        q_lens, seq_lens = random_batch(rng)
        if trial % 2 == 0:
            q_lens.append(1)  # a long decode row: split-KV
            seq_lens.append(int(rng.integers(1500, 3000)))
        if trial % 3 == 0:
            # a 192-row boundary chunk, and a long one that the unpacked rule tiles unpacked
            for ql in (int(rng.choice([191, 192, 193, 385])), 1536):
                q_lens.append(ql)
                seq_lens.append(ql + int(rng.integers(0, 130)))
        qsl, sl = qsl_of(q_lens), np.asarray(seq_lens, np.int32)
        for cm, nc, unp in ((None, 132, False), (CHEAP_SPLIT_MODEL, 16, False),
                            (CHEAP_SPLIT_MODEL, 16, True)):
            p = plan(qsl, sl, num_kv_heads=2, group_size=g, num_ctas=nc, cost_model=cm,
                     max_splits=8, tile_m=TM3, unpacked_prefill=unp)
            groups = check_plan_128(p, q_lens, seq_lens, hkv=2, g=g, tm=TM3)
            got_split += bool(groups)
            got_unpacked += int((p.work[:, W_QHEAD] >= 0).sum())
            bound = worst_case_items(len(q_lens), max(1, sum(q_lens)), max(1, max(seq_lens)),
                                     2, g, tile_m=TM3, max_splits=8, unpacked_prefill=unp)
            assert p.n_items <= bound
    assert got_split > 0
    if g in (3, 7):
        assert got_unpacked > 0


def test_tile_m_192_prefill_tiles():
    one = qsl_of([8192])
    p = plan(one, np.asarray([8192], np.int32), num_kv_heads=4, group_size=7, num_ctas=132,
             tile_m=TM3, unpacked_prefill=True)
    # 43 tiles of one q head x 192 tokens (the last holds 128) for each of the 28 q heads
    assert p.n_items == 28 * 43 and (p.work[:, W_QHEAD] >= 0).all()
    assert p.work[:, 3].max() == 192 and sorted(set(p.work[:, 3].tolist())) == [128, 192]
    # causal bound: the tile of tokens t0 .. t0+191 reads pages 0 .. (t0 + 191) // 64
    assert ((p.work[:, 5] - 1) == (p.work[:, 2] + p.work[:, 3] - 1) // 64).all()


def test_device_plan_records_tile_m_192():
    from cute_kernels.attention import DevicePlan, make_device_plan

    qsl, sl = qsl_of([1, 1536]), np.asarray([900, 1573], np.int32)
    p192 = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, tile_m=TM3)
    p128 = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, tile_m=128)
    kw = dict(item_capacity=256, group_capacity=16, partial_rows_capacity=4096, num_ctas=8,
              head_dim=128, device="cpu")
    d = DevicePlan(tile_m=TM3, **kw)
    assert d.tile_m == 192 and d.consumers == 3
    d.upload(p192)
    with pytest.raises(RuntimeError, match="tile_m"):
        d.upload(p128)
    with pytest.raises(ValueError, match="kv_pair"):
        DevicePlan(tile_m=TM3, kv_pair=True, **kw)
    with pytest.raises(ValueError, match="pingpong"):
        DevicePlan(tile_m=TM3, pingpong=True, **kw)
    with pytest.raises(ValueError, match="tile_m"):
        DevicePlan(tile_m=256, **kw)
    md = make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, page_size=64, head_dim=128,
                          device="cpu", num_ctas=8, tile_m=TM3, unpacked_prefill=True)
    assert md.tile_m == 192 and md.consumers == 3 and (md.host.work[:, W_QHEAD] >= 0).any()


# ----------------------------------------------------------------------- sm_90a compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402
from script_loader import load_script  # noqa: E402
from test_two_consumers_cpu import _barrier_init_counts, _check_no_spills, _sass  # noqa: E402

loop_mix = load_script("sass_profile.py", "sass_profile").loop_mix

#: one SM's shared memory a CTA may use on Hopper (227 KiB)
SM90_SMEM = 227 * 1024


@pytest.mark.parametrize("unpacked,fused", [(False, False), (True, False), (False, True),
                                            (True, True)],
                         ids=["plain", "unpacked", "fused", "fused-unpacked"])
@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_three_consumer_variants_compile(vi, unpacked, fused):
    v = ALL_VARIANTS[vi]
    if fused:
        fn = attention.make_fused_kernel(v, unpacked, consumers=3)
        kernel = fn.__self__
        art = compile_sm90a(fn, *attention.fused_fake_args(v, unpacked),
                            compile_options="--enable-tvm-ffi", keep_cubin=True)
        stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.global\.shared::cta", art.ptx))
        assert stores == 2 * (v.head_dim // 64), "fresh K/V writeback stores"
        assert art.has("setmaxnreg.dec.sync.aligned.u32 \t40;")
        assert art.has("setmaxnreg.inc.sync.aligned.u32 \t144;")
    else:
        kernel = attention.make_kernel(v, unpacked, consumers=3)
        art = compile_sm90a(kernel, *attention.fake_args(v, unpacked),
                            compile_options="--enable-tvm-ffi", keep_cubin=True)
        assert art.has("setmaxnreg.dec.sync.aligned.u32 \t24;")
        assert art.has("setmaxnreg.inc.sync.aligned.u32 \t144;")
    assert art.has("wgmma.mma_async") and art.has("cp.async.bulk.tensor")
    assert ".reqntid 512, 1, 1" in art.ptx and ".minnctapersm 1" in art.ptx
    # the register split fits the 64K file at 512 threads
    assert 128 * kernel.producer_regs + 384 * kernel.consumer_regs <= 65536
    stages = attention.kv_stages_for(3, v.page_size)
    assert kernel.kv_stages == stages == 4
    n = 2 + 2 * stages
    assert _barrier_init_counts(art.ptx) == [1] * n + [12] * n
    assert kernel.shared_storage.size_in_bytes() <= SM90_SMEM
    _check_no_spills(art)
    sass = _sass(art.cubin)
    if sass is not None:
        # the steady state: one 64-key page a trip (QK^T 8 x m64n64k16, PV m64n{D}k16), its
        # 32 exp2 a thread plus the two row corrections, not a duplicated set (with 152-160
        # consumer registers ptxas emitted 66 in some D = 128 variants; D = 64 has 66 at any)
        mix = loop_mix(sass)
        assert mix is not None
        if v.head_dim == 128:
            assert mix["counts"]["MUFU.EX2"] == 34
        assert sum(n for op, n in mix["hgmma"].items() if op.startswith("HGMMA.64x64x16")) == 8
    if not unpacked:
        # Q: three 64-row boxes per stage, K, V: one TMA load site per 64 columns of D each
        loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\w+\.shared::c\w+\.global", art.ptx))
        assert loads == (5 + (2 if fused else 0)) * (v.head_dim // 64)


def test_three_consumer_refusals():
    from cute_kernels.attention_sm90 import IonAttentionSm90

    k = IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=3)
    assert (k.threads, k.ctas_per_sm, k.tokens_per_tile, k.tile_rows) == (512, 1, 24, 192)
    with pytest.raises(ValueError, match="ctas_per_sm"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=3, ctas_per_sm=2)
    with pytest.raises(ValueError, match="kv_pair"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=3, kv_pair=True)
    with pytest.raises(ValueError, match="pingpong"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, consumers=3, pingpong=True)
    with pytest.raises(ValueError, match="kv_pair"):
        attention.make_kernel(ALL_VARIANTS[7], consumers=3, kv_pair=True)
    # K/V depth is an option of the 192-row kernels too; the default depth is one kernel
    assert attention.check_kv_stages(4, 3) is None and attention.check_kv_stages(3, 3) == 3


@pytest.mark.parametrize("consumers,fused", [(2, True), (3, True), (3, False)],
                         ids=["m128-fused", "m192-fused", "m192-plain"])
def test_skip_idle_variants_guard_their_mmas(consumers, fused):
    """``skip_idle=True``: the 128/192-row kernels keep the same wgmmas and steady state
    (34 exp2 a page, 8 QK^T + 4 PV HGMMAs), gain the branches that skip a warpgroup's MMAs
    when its rows hold no token, and compile spill-free; at consumers=1 the flag is dropped
    and the PTX is the default's."""
    v = ALL_VARIANTS[7]
    make = attention.make_fused_kernel if fused else attention.make_kernel
    fake = attention.fused_fake_args if fused else attention.fake_args
    arts = {}
    for si in (False, True):
        fn = make(v, True, consumers=consumers, skip_idle=si)
        kernel = fn.__self__ if fused else fn
        assert kernel.skip_idle is si
        arts[si] = compile_sm90a(fn, *fake(v, True), compile_options="--enable-tvm-ffi",
                                 keep_cubin=True)
    plain, skip = arts[False], arts[True]
    assert plain.ptx != skip.ptx
    mma = r"wgmma\.mma_async"
    assert skip.count(mma) == plain.count(mma) > 0
    assert skip.count(r"\bbra\b") > plain.count(r"\bbra\b")
    assert not skip.has("st.local")
    sass = _sass(skip.cubin)
    if sass is not None:
        _check_no_spills(skip)
        mix = loop_mix(sass)
        assert mix["counts"]["MUFU.EX2"] == 34
        assert sum(n for op, n in mix["hgmma"].items() if op.startswith("HGMMA.64x64x16")) == 8
    one = attention.make_fused_kernel(v, True, consumers=1, skip_idle=True).__self__
    assert not one.skip_idle
