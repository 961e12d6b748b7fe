"""CPU tests of the plain-PyTorch IonAttention API (``cute_kernels``): ``KernelOptions`` (the
compile key) and what follows from it, input refusal, ``DevicePlan`` (static buffers
refilled in place every step) and ``make_device_plan``, and what ``ion_attention`` and
``precompile`` hand to the compiled-kernel caches (the kernels replaced by recorders)."""

import sys
import types

import numpy as np
import pytest
import torch

from cute_kernels import attention
from cute_kernels import worklist as W
from cute_kernels.attention import check_inputs, check_new_kv
from cute_kernels.device_plan import HOPPER_SMS, DevicePlan, grid_ctas, make_device_plan, num_sms
from cute_kernels.options import (
    SUPPORTED_TILE_M,
    KernelOptions,
    all_kernel_options,
    dtype_name,
    group_pad_for,
)
from cute_kernels.planner import pack_plan, plan
from plan_checks import CHEAP_SPLIT_MODEL, check_plan, qsl_of, seeded  # noqa: F401  (fixture)


# ----------------------------------------------------------------------- KernelOptions
def test_kernel_options_defaults_and_key():
    o = KernelOptions()
    assert (o.dtype, o.head_dim, o.group_pad, o.tile_m, o.fresh_kv) == (
        "bfloat16", 128, 8, 64, False)
    assert KernelOptions("bfloat16", 128, 8, 64, False) == o and hash(o) == hash(KernelOptions())
    assert len({o, KernelOptions(fresh_kv=True), KernelOptions(tile_m=128)}) == 3
    with pytest.raises(AttributeError):
        o.tile_m = 128  # frozen: the compile-cache key cannot change under a cached kernel
    assert o.combine_key == ("bfloat16", 128, 8)
    assert KernelOptions(tile_m=192, fresh_kv=True).combine_key == o.combine_key


@pytest.mark.parametrize("field,value,err,match", [
    ("dtype", "float32", TypeError, "supports"),
    ("dtype", "float8_e4m3fn", TypeError, "supports"),
    ("head_dim", 96, ValueError, "head sizes"),
    ("head_dim", 512, ValueError, "head sizes"),
    ("group_pad", 3, ValueError, "group_pad"),
    ("group_pad", 32, ValueError, "group_pad"),
    ("tile_m", 96, ValueError, "tile_m"),
    ("tile_m", 256, ValueError, "tile_m"),
])
def test_kernel_options_refuse_what_no_kernel_implements(field, value, err, match):
    with pytest.raises(err, match=match):
        KernelOptions(**{field: value})


def test_for_layer_pads_the_gqa_group():
    assert KernelOptions.for_layer(torch.bfloat16, 128, 28, 4) == KernelOptions("bfloat16", 128, 8)
    assert KernelOptions.for_layer("float16", 64, 32, 32, 192, True) == KernelOptions(
        "float16", 64, 1, 192, True)
    assert KernelOptions.for_layer("torch.bfloat16", 128, 12, 4).group_pad == 4
    assert [group_pad_for(g) for g in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    assert dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="GQA ratios"):
        KernelOptions.for_layer(torch.bfloat16, 128, 68, 4)  # G = 17
    with pytest.raises(ValueError, match="multiple"):
        KernelOptions.for_layer(torch.bfloat16, 128, 30, 4)
    with pytest.raises(ValueError, match="multiple"):
        KernelOptions.for_layer(torch.bfloat16, 128, 8, 0)
    with pytest.raises(TypeError):
        KernelOptions.for_layer(torch.float32, 128, 28, 4)
    with pytest.raises(ValueError, match="tile_m"):
        KernelOptions.for_layer(torch.bfloat16, 128, 28, 4, tile_m=96)


def test_all_kernel_options_is_every_combination_once():
    opts = all_kernel_options()
    assert len(opts) == 160 == len(set(opts))
    assert {(o.dtype, o.head_dim, o.group_pad, o.tile_m, o.fresh_kv) for o in opts} == {
        (dt, d, gp, tm, fr) for dt in ("bfloat16", "float16") for d in (64, 128, 256)
        for gp in (1, 2, 4, 8, 16) for tm in ((64, 128) if d == 256 else (64, 128, 192))
        for fr in (False, True)}
    assert len({o.combine_key for o in opts}) == 30


def test_head_size_256_has_no_192_row_tile():
    for fresh in (False, True):
        with pytest.raises(ValueError, match="tile_m must be one of \\(64, 128\\) at head size 256"):
            KernelOptions("bfloat16", 256, 8, 192, fresh)


#: (producer, consumer) registers after setmaxnreg, as ``KernelOptions.registers`` says:
#: key (consumers, fresh_kv, head_dim 64 or 256: the wider straddle copy); head size 256
#: with one consumer (one CTA an SM): WIDE_ONE
WIDE_ONE = {False: (24, 240), True: (48, 240)}
REGISTERS = {(1, False, False): (24, 232), (1, False, True): (24, 232),
             (1, True, False): (40, 216), (1, True, True): (48, 208),
             (2, False, False): (24, 240), (2, False, True): (24, 240),
             (2, True, False): (40, 232), (2, True, True): (48, 224),
             (3, False, False): (24, 144), (3, False, True): (24, 144),
             (3, True, False): (40, 144), (3, True, True): (48, 144)}
SM90_REGS_PER_SM = 65536
SM90_SMEM_PER_SM = 228 * 1024  # H100/H200: 228 KiB, 1 KiB reserved per resident CTA
SM90_SMEM_PER_CTA = 227 * 1024  # the most dynamic shared memory one CTA may ask for


@pytest.mark.parametrize("o", all_kernel_options(), ids=lambda o: (
    f"{o.dtype[:2]}-d{o.head_dim}-gp{o.group_pad}-m{o.tile_m}" + ("-fused" if o.fresh_kv else "")))
def test_derived_launch_shape(o):
    c = o.tile_m // 64
    assert o.consumers == c and o.threads == 128 * (1 + c)
    if o.head_dim == 256:  # one CTA an SM, 2 K/V stages, one Q buffer a consumer at 128 rows
        assert (o.ctas_per_sm, o.kv_stages, o.q_stages) == (1, 2, 2 if c == 1 else 1)
    else:
        assert (o.ctas_per_sm, o.kv_stages, o.q_stages) == ((2, 2, 2) if c == 1 else (1, 4, 2))
    prod, cons = o.registers
    want = (WIDE_ONE[o.fresh_kv] if o.head_dim == 256 and c == 1
            else REGISTERS[(c, o.fresh_kv, o.head_dim in (64, 256))])
    assert (prod, cons) == want
    # setmaxnreg: multiples of 8 in [24, 256], and the split fits what every thread of the
    # resident CTAs gets at launch (so setmaxnreg.inc never waits for registers)
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in (prod, cons))
    entry = SM90_REGS_PER_SM // (o.threads * o.ctas_per_sm) // 8 * 8
    assert 128 * prod + 128 * c * cons <= entry * o.threads
    # shared memory: K and V stages of one 64-token page, one 64-row Q buffer per consumer
    # and Q stage, 2 KiB of barriers and reserve, for every resident CTA
    per_cta = (2 * o.kv_stages * 64 * o.head_dim * 2 + o.q_stages * c * 64 * o.head_dim * 2
               + 2 * 1024)
    assert per_cta <= SM90_SMEM_PER_CTA and o.ctas_per_sm * per_cta <= SM90_SMEM_PER_SM
    assert o.smem_bytes + 2 * 1024 == per_cta


# ------------------------------------------------------------------- input refusal
def _inputs(**over):
    t = dict(q=torch.randn(5, 8, 128).bfloat16(), k=torch.randn(3, 2, 64, 128).bfloat16(),
             v=torch.randn(3, 2, 64, 128).bfloat16(), out=torch.empty(5, 8, 128).bfloat16(),
             qsl=torch.tensor([0, 5], dtype=torch.int32), sl=torch.tensor([70], dtype=torch.int32),
             bt=torch.tensor([[0, 2]], dtype=torch.int32))
    t.update(over)
    return t["q"], t["k"], t["v"], t["out"], t["qsl"], t["sl"], t["bt"]


def test_check_inputs_refuses_tensors_not_on_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        check_inputs(*_inputs())
    with pytest.raises(ValueError, match="CUDA device"):
        attention.ion_attention(*_inputs(), 0.1)


def test_check_new_kv_refuses_bad_key_value():
    q = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(3, 2, 64, 128, dtype=torch.bfloat16)
    key = torch.zeros(5, 2, 128, dtype=torch.bfloat16)
    check_new_kv(q, key, key.clone(), kc)  # fine
    check_new_kv(q, None, None, kc)
    # a view of a fused qkv projection (16-byte strides) is fine
    qkv = torch.zeros(5, (8 + 4) * 128, dtype=torch.bfloat16)
    k_view = qkv[:, 8 * 128:10 * 128].unflatten(1, (2, 128))
    check_new_kv(q, k_view, k_view, kc)
    with pytest.raises(ValueError, match="both key and value"):
        check_new_kv(q, key, None, kc)
    with pytest.raises(ValueError, match="both key and value"):
        check_inputs(*_inputs(), key=key)  # refused before the device check
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        check_new_kv(q, key[:4], key[:4], kc)
    with pytest.raises(ValueError, match=r"\[T, Hkv, D\]"):
        check_new_kv(q, key[:, :1], key[:, :1], kc)
    with pytest.raises(TypeError, match="dtype"):
        check_new_kv(q, key.half(), key.half(), kc)
    meta = torch.zeros(5, 2, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="device"):
        check_new_kv(q, meta, meta, kc)
    base = torch.zeros(5, 2 * 128 + 4, dtype=torch.bfloat16)
    odd = base[:, 4:].unflatten(1, (2, 128))  # 8-byte offset, 520-byte token stride
    with pytest.raises(ValueError, match="16 bytes|16-byte"):
        check_new_kv(q, odd, odd, kc)


# ------------------------------------------------------------------------ DevicePlan
def _plan(q_lens, seq_lens, num_ctas=8, **kw):
    return plan(qsl_of(q_lens), np.asarray(seq_lens, np.int32), num_kv_heads=2, group_size=4,
                num_ctas=num_ctas, **kw)


def _buffers(dp):
    return [t.data_ptr() for t in (dp.work, dp.cta_offsets, dp.partial_offsets, dp.combine,
                                   dp.partial_o, dp.partial_lse)]


def test_device_plan_refills_the_same_buffers_and_clears_stale_rows():
    big = _plan([1] * 6 + [300], [9000] * 6 + [300], max_partial_rows=4096)
    small = _plan([1, 1], [65, 10])
    assert big.combine.shape[0] > 0, "the long decodes should be split"
    dp = DevicePlan(item_capacity=big.n_items, group_capacity=big.combine.shape[0],
                    partial_rows_capacity=4096, num_ctas=8, head_dim=128, device="cpu",
                    always_combine=True)
    assert dp.work.shape == (big.n_items, W.WORK_COLS) and dp.partial_o.shape == (4096, 128)
    assert dp.partial_lse.shape == (4096,) and dp.partial_o.dtype == torch.float32
    assert dp.fresh_kv is None and dp.host is None and dp.always_combine
    ptrs = _buffers(dp)
    assert dp.upload(big) is dp and dp.host is big and dp.fresh_kv is False
    np.testing.assert_array_equal(dp.work[: big.n_items].numpy(), big.work)
    np.testing.assert_array_equal(dp.partial_offsets[: big.n_items].numpy(), big.partial_offsets)
    np.testing.assert_array_equal(dp.combine[: big.combine.shape[0]].numpy(), big.combine)
    assert dp.num_groups == big.combine.shape[0] and (dp.combine[:, W.C_NTOK] >= 1).all()
    dp.upload(small)
    assert _buffers(dp) == ptrs
    np.testing.assert_array_equal(dp.work[: small.n_items].numpy(), small.work)
    assert not dp.work[small.n_items:].any(), "stale items of the bigger plan must be cleared"
    assert torch.all(dp.partial_offsets[small.n_items:] == -1)
    assert not dp.combine.any(), "no split groups in the small plan: all rows are padding"
    np.testing.assert_array_equal(dp.cta_offsets.numpy(), small.cta_offsets)
    assert dp.num_items == small.n_items and dp.num_groups == 0


def test_device_plan_equals_a_fresh_pack_after_any_upload_sequence(seeded):
    """Through its two alternating staging buffers, every upload leaves the device buffers
    byte-equal to packing that plan into zeroed buffers: no stale item, offset or combine
    group of any earlier plan (fused or not, more groups than items or not) survives."""
    rng = seeded.rng()
    kw = dict(num_kv_heads=1, group_size=7, num_ctas=40, tile_m=128, unpacked_prefill=True,
              max_partial_rows=1 << 16)
    dp = DevicePlan(item_capacity=2048, group_capacity=2048, partial_rows_capacity=1 << 16,
                    num_ctas=40, head_dim=64, device="cpu", tile_m=128)
    for step in range(12):
        n = int(rng.integers(1, 5))
        q = [int(x) for x in rng.choice([0, 1, 1, 70, 300, 1000], size=n)]
        sl = [ql + int(rng.integers(0, 4000)) for ql in q]
        fresh = bool(rng.integers(0, 2))
        cm = CHEAP_SPLIT_MODEL if rng.random() < 0.5 else None
        p = plan(qsl_of(q), np.asarray(sl, np.int32), fresh_kv=fresh, cost_model=cm, **kw)
        ref = [np.zeros((2048, W.WORK_COLS), np.int32), np.zeros(41, np.int32),
               np.full(2048, -1, np.int32), np.zeros((2048, W.COMBINE_COLS), np.int32)]
        pack_plan(p, *ref)
        dp.upload(p)
        with seeded.case(step=step, q=q, sl=sl, fresh=fresh, cheap=cm is not None):
            for got, want in zip((dp.work, dp.cta_offsets, dp.partial_offsets, dp.combine), ref):
                np.testing.assert_array_equal(got.numpy(), want)
            assert (dp.num_items, dp.num_groups, dp.fresh_kv) == (
                p.n_items, p.combine.shape[0], fresh)


def test_device_plan_refuses_plans_it_cannot_hold():
    p = _plan([1] * 6 + [300], [9000] * 6 + [300], max_partial_rows=4096)
    g = p.combine.shape[0]
    kw = dict(num_ctas=8, head_dim=64, device="cpu")
    with pytest.raises(RuntimeError, match="capacity"):
        DevicePlan(item_capacity=p.n_items - 1, group_capacity=64, partial_rows_capacity=4096,
                   **kw).upload(p)
    with pytest.raises(RuntimeError, match="capacity"):
        DevicePlan(item_capacity=p.n_items, group_capacity=g - 1, partial_rows_capacity=4096,
                   **kw).upload(p)
    with pytest.raises(RuntimeError, match="partial rows"):
        DevicePlan(item_capacity=p.n_items, group_capacity=64, partial_rows_capacity=1,
                   **kw).upload(p)
    with pytest.raises(ValueError, match="CTAs"):
        DevicePlan(item_capacity=64, group_capacity=64, partial_rows_capacity=4096,
                   num_ctas=4, head_dim=64, device="cpu").upload(p)
    with pytest.raises(ValueError, match="tile_m"):
        DevicePlan(item_capacity=1, group_capacity=1, partial_rows_capacity=0, tile_m=96, **kw)
    empty = DevicePlan(item_capacity=0, group_capacity=0, partial_rows_capacity=0, **kw)
    assert empty.item_capacity == empty.group_capacity == 1 and empty.partial_o.shape[0] == 1


@pytest.mark.parametrize("tile_m", SUPPORTED_TILE_M)
def test_device_plan_runs_plans_of_its_tile_size_only(tile_m):
    qsl, sl = qsl_of([1, 1536]), np.asarray([900, 1573], np.int32)
    kw = dict(item_capacity=1024, group_capacity=64, partial_rows_capacity=1 << 14, num_ctas=8,
              head_dim=128, device="cpu")
    dp = DevicePlan(tile_m=tile_m, **kw)
    assert dp.tile_m == tile_m
    for other in SUPPORTED_TILE_M:
        p = plan(qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, tile_m=other,
                 unpacked_prefill=True)
        if other == tile_m:
            np.testing.assert_array_equal(dp.upload(p).work[: p.n_items].numpy(), p.work)
        else:
            with pytest.raises(RuntimeError, match="tile_m"):
                dp.upload(p)


def test_grid_on_a_device_that_is_not_a_gpu():
    assert num_sms("cpu") == HOPPER_SMS == 132
    assert [grid_ctas("cpu", tm) for tm in SUPPORTED_TILE_M] == [264, 132, 132]


@pytest.mark.parametrize("q_lens,seq_lens,want", [
    ([8192], [8192], 192),                       # prefill: 43 x 28 tiles of 192 tokens
    ([1024], [8192], 128),                       # a chunk: too few 192-row tiles
    ([1] * 32 + [2048], [8192] * 32 + [2048], 64),  # decode-heavy mix
    ([1, 1], [700, 9], 64),                      # decode only
])
@pytest.mark.parametrize("fresh_kv", [False, True])
def test_make_device_plan_auto(q_lens, seq_lens, want, fresh_kv):
    """``tile_m="auto"`` picks the backend's tile size for the batch (28/4 heads, d 128),
    plans it unpacked on the grid of that size, and uploads it into buffers of exactly its
    size."""
    qsl, sl = qsl_of(q_lens), np.asarray(seq_lens, np.int32)
    dp = make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, head_dim=128, device="cpu",
                          fresh_kv=fresh_kv)
    assert dp.tile_m == want and dp.num_ctas == grid_ctas("cpu", want)
    assert dp.fresh_kv is fresh_kv and dp.host.unpacked and not dp.always_combine
    ref = plan(qsl, sl, num_kv_heads=4, group_size=7, num_ctas=dp.num_ctas, tile_m=want,
               fresh_kv=fresh_kv, unpacked_prefill=True)
    np.testing.assert_array_equal(dp.host.work, ref.work)
    np.testing.assert_array_equal(dp.work.numpy()[: ref.n_items], ref.work)
    assert dp.item_capacity == max(1, ref.n_items)
    assert dp.partial_rows_capacity == ref.partial_rows


def test_make_device_plan_forced_sizes_and_grid():
    qsl, sl = qsl_of([1, 256]), np.asarray([900, 296], np.int32)
    for tile_m in SUPPORTED_TILE_M:
        dp = make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, head_dim=128,
                              device="cpu", tile_m=tile_m, num_ctas=8)
        assert dp.tile_m == tile_m and dp.num_ctas == 8 and dp.host.tile_m == tile_m
        check_plan(dp.host, qsl, sl, num_kv_heads=2, group_size=7, num_ctas=8, tile_m=tile_m,
                   unpacked=True)
    # batch invariance: packed 64-row tiles, no split, whatever tile_m says
    long = (qsl_of([1, 1, 512]), np.asarray([40000, 9000, 512], np.int32))
    assert make_device_plan(*long, num_kv_heads=2, group_size=7, head_dim=128, device="cpu",
                            tile_m=64).num_groups > 0
    for tile_m in ("auto", 64):
        dp = make_device_plan(*long, num_kv_heads=2, group_size=7, head_dim=128, device="cpu",
                              tile_m=tile_m, batch_invariant=True)
        assert dp.tile_m == 64 and dp.num_ctas == 264 and not dp.host.unpacked
        assert dp.host.num_splits_max == 1 and dp.num_groups == 0
        check_plan(dp.host, *long, num_kv_heads=2, group_size=7, num_ctas=264)
    # a cost model that makes splitting cheap forces split-KV (the GPU tests' way)
    dp = make_device_plan(qsl_of([1]), np.asarray([9000], np.int32), num_kv_heads=2,
                          group_size=4, head_dim=64, device="cpu", tile_m=64,
                          cost_model=CHEAP_SPLIT_MODEL, max_splits=4)
    assert dp.host.num_splits_max == 4 and dp.num_groups == 2
    assert dp.partial_rows_capacity == dp.host.partial_rows > 0
    with pytest.raises(ValueError, match="tile_m"):
        make_device_plan(qsl, sl, num_kv_heads=2, group_size=7, head_dim=128, device="cpu",
                         tile_m=96)


# ---------------------------------------------------------------- launches, recorded
@pytest.fixture
def launches(monkeypatch):
    """``ion_attention`` with the device check passed and the compiled kernels replaced by
    recorders: [("attn", options, args) | ("combine", options, args)]."""
    seen = []

    def fake_check(q, k_cache, v_cache, out, qsl, sl, bt, key=None, value=None):
        check_new_kv(q, key, value, k_cache)
        return q.shape[0], q.shape[1], k_cache.shape[1], q.shape[2]

    monkeypatch.setattr(attention, "check_inputs", fake_check)
    monkeypatch.setattr(attention, "compiled_attention",
                        lambda o: (lambda *a: seen.append(("attn", o, a))))
    monkeypatch.setattr(attention, "compiled_combine",
                        lambda o: (lambda *a: seen.append(("combine", o, a))))
    return seen


def _call(hq=28, hkv=4, d=128, t=300, fused=False, dtype=torch.bfloat16, **kw):
    q = torch.zeros(t, hq, d, dtype=dtype)
    kc = torch.zeros(4, hkv, 64, d, dtype=dtype)
    kv = torch.zeros(t, hkv, d, dtype=dtype) if fused else None
    qsl = torch.tensor([0, t], dtype=torch.int32)
    sl = torch.tensor([t + 700], dtype=torch.int32)
    bt = torch.zeros(1, 16, dtype=torch.int32)
    return q, (q, kc, kc, q, qsl, sl, bt, 0.125), dict(key=kv, value=kv, **kw)


@pytest.mark.parametrize("fused", [False, True])
def test_ion_attention_launches_the_kernel_of_the_plan(launches, fused):
    q, args, kw = _call(fused=fused)
    qsl, sl = args[4].numpy(), args[5].numpy()
    for tile_m in SUPPORTED_TILE_M:
        launches.clear()
        dp = make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, head_dim=128,
                              device="cpu", tile_m=tile_m, fresh_kv=fused)
        assert attention.ion_attention(*args, plan=dp, **kw) is q
        want = KernelOptions("bfloat16", 128, 8, tile_m, fused)
        assert [(k, o) for k, o, _ in launches] == [("attn", want)] + (
            [("combine", want)] if dp.num_groups else [])
        a = launches[0][2]
        # (q, [key, value,] k_cache, v_cache, out, qsl, seq_lens, block_table, work,
        #  cta_offsets, partial_offsets, partial_o, partial_lse, sinks_log2, G,
        #  scale * log2(e), softcap, scale / softcap, window, ctas)
        rest = a[3:] if fused else a[1:]
        assert a[0] is q and (not fused or (a[1] is kw["key"] and a[2] is kw["value"]))
        assert rest[:6] == args[1:3] + (q,) + args[4:7]
        assert rest[6] is dp.work and rest[7] is dp.cta_offsets and rest[8] is dp.partial_offsets
        assert rest[9] is dp.partial_o and rest[10] is dp.partial_lse
        assert rest[11].shape == (28,) and torch.isneginf(rest[11]).all()  # no sinks
        rest = rest[:11] + rest[12:]
        assert rest[11] == 7 and rest[12] == pytest.approx(0.125 * attention.LOG2_E)
        assert rest[13:16] == (0.0, 0.0, 0) and rest[16] == dp.num_ctas
        launches.clear()  # a soft cap moves the scale inside tanh
        attention.ion_attention(*args, plan=dp, softcap=50.0, **kw)
        rest = launches[0][2][3:] if fused else launches[0][2][1:]
        rest = rest[:11] + rest[12:]
        assert rest[12] == pytest.approx(attention.LOG2_E)
        assert rest[13:15] == (50.0, pytest.approx(0.125 / 50.0))
        # a window needs a plan pruned to it
        with pytest.raises(ValueError, match="window"):
            attention.ion_attention(*args, plan=dp, window=128, **kw)
        wp = make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, head_dim=128,
                              device="cpu", tile_m=tile_m, fresh_kv=fused, window=128)
        launches.clear()
        sinks = torch.linspace(-2.0, 2.0, 28)
        attention.ion_attention(*args, plan=wp, window=128, sinks_log2=attention.sink_log2(sinks),
                                **kw)
        rest = launches[0][2][3:] if fused else launches[0][2][1:]
        assert rest[16] == 128
        assert torch.allclose(rest[11], sinks * attention.LOG2_E)
        if dp.num_groups:  # the combine merges with the same sinks
            assert launches[1][2][5] is rest[11]
        with pytest.raises(ValueError, match="sinks_log2"):
            attention.ion_attention(*args, plan=wp, window=128, sinks_log2=sinks[:4], **kw)


def test_ion_attention_combine_and_plan_rules(launches):
    q, args, kw = _call(t=1)
    qsl, sl = np.array([0, 1], np.int32), np.array([40000], np.int32)
    args = args[:5] + (torch.from_numpy(sl),) + args[6:]
    split = make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, head_dim=128,
                             device="cpu", tile_m=64)
    assert split.num_groups > 0
    attention.ion_attention(*args, plan=split, **kw)
    assert [k for k, _, _ in launches] == ["attn", "combine"]
    comb = launches[1][2]
    assert comb[0] is q and comb[2] is split.combine and comb[6:] == (7, split.num_ctas)
    assert torch.isneginf(comb[5]).all()  # no sinks
    # no split groups: the combine runs only when the plan says always (graph capture)
    launches.clear()
    plain = make_device_plan(qsl, np.array([100], np.int32), num_kv_heads=4, group_size=7,
                             head_dim=128, device="cpu", tile_m=64)
    attention.ion_attention(*args, plan=plain, **kw)
    plain.always_combine = True
    attention.ion_attention(*args, plan=plain, **kw)
    assert [k for k, _, _ in launches] == ["attn", "attn", "combine"]
    # a plan of the other kind is refused before any launch
    launches.clear()
    _, fused_args, fused_kw = _call(t=1, fused=True)
    with pytest.raises(ValueError, match="fresh_kv=True plan"):
        attention.ion_attention(*fused_args, plan=plain, **fused_kw)
    fresh = make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, head_dim=128,
                             device="cpu", fresh_kv=True)
    with pytest.raises(ValueError, match="fresh_kv=False plan"):
        attention.ion_attention(*args, plan=fresh, **kw)
    assert launches == []
    # no rows: nothing to launch
    empty_args = (q[:0], *args[1:3], q[:0], torch.tensor([0, 0], dtype=torch.int32),
                  torch.tensor([5], dtype=torch.int32), args[6], 0.125)
    attention.ion_attention(*empty_args, query_start_loc_cpu=np.array([0, 0]),
                            seq_lens_cpu=np.array([5]))
    assert launches == []


def test_ion_attention_plans_from_the_host_copies(launches, monkeypatch):
    """Without a plan, ``ion_attention`` plans the batch from the ``*_cpu`` copies (device
    tensors are not read) for the call's kind, tile size auto."""
    made = []
    real = attention.make_device_plan
    monkeypatch.setattr(attention, "make_device_plan",
                        lambda *a, **k: made.append((a, k)) or real(*a, **k))
    for fused in (False, True):
        q, args, kw = _call(t=1024, fused=fused)
        bogus = (args[:4] + (torch.tensor([0, 5], dtype=torch.int32),
                             torch.tensor([6], dtype=torch.int32)) + args[6:])
        attention.ion_attention(*bogus, query_start_loc_cpu=np.array([0, 1024]),
                                seq_lens_cpu=np.array([1024]), **kw)
        a, k = made[-1]
        assert a[0].tolist() == [0, 1024] and a[1].tolist() == [1024]
        assert k["fresh_kv"] is fused and (k["num_kv_heads"], k["group_size"]) == (4, 7)
        assert launches[-1][1].tile_m == 128  # 6 x 28 tiles of 192 < 2.25 x 132
        assert launches[-1][1].fresh_kv is fused


def test_precompile_builds_every_kernel_it_is_given(monkeypatch):
    built = []
    monkeypatch.setattr(attention, "compiled_attention", lambda o: built.append(("attn", o)))
    monkeypatch.setattr(attention, "compiled_combine", lambda o: built.append(("combine", o)))
    fake = types.ModuleType("cute_kernels.append_sm90")
    fake.compiled_kv_append = lambda *a: built.append(("kv_append", a))
    monkeypatch.setitem(sys.modules, "cute_kernels.append_sm90", fake)
    opts = [KernelOptions.for_layer(torch.bfloat16, 128, 28, 4, tm, True) for tm in (64, 128)]
    attention.precompile(iter(opts), num_kv_heads=4)
    # fused kernels write the cache themselves: no kv_append
    assert built == [("attn", opts[0]), ("combine", opts[0]), ("attn", opts[1]),
                     ("combine", opts[1])]
    built.clear()
    plain = [KernelOptions.for_layer(torch.float16, 64, 8, 8, 64)]
    attention.precompile(plain, num_kv_heads=8)
    assert built == [("attn", plain[0]), ("combine", plain[0]),
                     ("kv_append", (torch.float16, 64, 8, 64, torch.int64))]
    built.clear()
    attention.precompile(plain)  # without the KV head count kv_append cannot be built
    assert [k for k, _ in built] == ["attn", "combine"]
