"""GPU (sm_90) tests of the fused eager KV writeback: ``ion_attention(..., key=, value=)``
reads the step's new K/V from ``key``/``value``, writes them into the paged cache by TMA
store inside the attention launch, and must match

* the fp32 reference (``reference_kv_append`` with the block-table slot mapping, then
  ``reference_paged_attention`` on the updated cache) on every row that has work (rel err
  <= 1e-2, no NaN; ``out`` is NaN-poisoned first and rows without work stay poisoned);
* the reference cache bit for bit at every position < seq_len of every request, while
  every block no request owns stays untouched (positions >= seq_len of a request's last
  page may hold garbage, docs/contract.md).

Batches: decode rows, prefill chunks whose cached prefix is not a page multiple, rows with
0 new tokens, page-boundary lengths, fresh prefills, long rows with split-KV forced, padded
token rows, key/value as strided views of a fused qkv buffer.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    new_token_slot_mapping,
    reference_kv_append,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)

from paged_gpu_checks import CHEAP_SPLIT

P = 64


def _new_kv(total_q, hq, hkv, d, dtype, gen, strided):
    """key/value [T, Hkv, D]; ``strided``: views of one fused qkv buffer (as vLLM passes)."""
    if strided:
        qkv = torch.randn(total_q, (hq + 2 * hkv) * d, generator=gen).to("cuda", dtype)
        key = qkv[:, hq * d:(hq + hkv) * d].view(total_q, hkv, d)
        value = qkv[:, (hq + hkv) * d:].view(total_q, hkv, d)
        return key, value
    key = torch.randn(total_q, hkv, d, generator=gen).to("cuda", dtype)
    value = torch.randn(total_q, hkv, d, generator=gen).to("cuda", dtype)
    return key, value


def _device_plan(qsl, sl, hkv, g, d, force_split, **plan_kw):
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=d, **CHEAP_SPLIT) if force_split else None
    return make_device_plan(qsl, sl, num_kv_heads=hkv, group_size=g, page_size=P, head_dim=d,
                            device="cuda", fresh_kv=True, cost_model=cm, **plan_kw)


def _run_case(q_lens, seq_lens, *, hq, hkv, d, dtype=torch.bfloat16, seed=0, pad_rows=0,
              force_split=False, strided=True, use_api_plan=False, plan_kw=None):
    from cute_kernels.attention import ion_attention

    case = make_paged_case(seed, q_lens, seq_lens, hq, hkv, d, page=P, dtype=dtype,
                           device="cuda", pad_rows=pad_rows)
    q, k_cache, v_cache, qsl, sl, bt = case
    total_q = q.shape[0]
    gen = torch.Generator().manual_seed(1000 + seed)
    key, value = _new_kv(total_q, hq, hkv, d, dtype, gen, strided)
    scale = default_softmax_scale(d)

    # reference: kv_append through the block-table slots, then attention on that cache
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = new_token_slot_mapping(qsl, sl, bt, P, total_q=total_q)
    reference_kv_append(key, value, ref_k, ref_v, slots)
    ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)

    k0, v0 = k_cache.clone(), v_cache.clone()
    out = torch.full_like(q, float("nan"))
    plan = None if use_api_plan else _device_plan(qsl.cpu(), sl.cpu(), hkv, hq // hkv, d,
                                                  force_split, **(plan_kw or {}))
    ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan, key=key, value=value)
    torch.cuda.synchronize()

    rows = written_rows_mask(qsl, sl, total_q).cuda()
    assert not torch.isnan(out[rows]).any(), "NaN in rows the kernel must write"
    assert torch.isnan(out[~rows]).all(), "rows without work were touched"
    err = relative_error(out, ref, rows)
    assert err <= 1e-2, f"rel err {err:.3e}"

    # cache: positions < seq_len equal the reference bitwise; foreign blocks untouched
    owned = torch.zeros(k_cache.shape[0], dtype=torch.bool)
    bt_h, sl_h = bt.cpu(), sl.cpu().tolist()
    for b, L in enumerate(sl_h):
        if L == 0:
            continue
        npg = -(-L // P)
        owned[bt_h[b, :npg].long()] = True
        pos = torch.arange(L)
        blk = bt_h[b, pos // P].long().cuda()
        row = (pos % P).cuda()
        for got, want, name in ((k_cache, ref_k, "K"), (v_cache, ref_v, "V")):
            g_rows = got[blk, :, row].view(torch.int16)
            w_rows = want[blk, :, row].view(torch.int16)
            bad = (g_rows != w_rows).flatten(1).any(1).nonzero()
            assert bad.numel() == 0, (f"{name} cache of request {b} differs at positions "
                                      f"{bad.flatten()[:8].tolist()} (ctx={L - q_lens[b]})")
    foreign = (~owned).nonzero().flatten().cuda()
    assert torch.equal(k_cache[foreign].view(torch.int16), k0[foreign].view(torch.int16))
    assert torch.equal(v_cache[foreign].view(torch.int16), v0[foreign].view(torch.int16))
    return plan


MIXED_Q = [1, 1, 1, 1, 100, 0, 200, 64, 65, 1, 37, 0, 130]
MIXED_L = [1, 65, 64, 1000, 137, 50, 200, 128, 128, 129, 37 + 300, 0, 130 + 70]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 8), (16, 4), (28, 4)])
def test_fused_mixed_batch(dtype, d, hq, hkv):
    _run_case(MIXED_Q, MIXED_L, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=hq + d, pad_rows=3)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(8, 8), (28, 4)])
def test_fused_forced_splits_on_long_rows(hq, hkv):
    q_lens = [1, 300, 1, 70, 0]
    seq_lens = [5000, 300 + 2000 + 17, 8191, 70 + 999, 30]
    plan = _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, seed=3, force_split=True)
    assert plan.host.num_splits_max > 1, "the long rows should have been split"


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_fused_random_batches(seed):
    rng = np.random.default_rng(seed)
    q_lens, seq_lens = [], []
    for _ in range(int(rng.integers(1, 12))):
        kind = int(rng.integers(0, 5))
        if kind == 0:
            ql, ctx = 1, int(rng.integers(0, 3000))
        elif kind == 1:
            ql, ctx = int(rng.integers(2, 400)), int(rng.integers(1, 900))
        elif kind == 2:
            ql, ctx = int(rng.integers(1, 300)), 0
        elif kind == 3:
            ql, ctx = 0, int(rng.integers(0, 200))
        else:
            ql = int(rng.choice([1, 63, 64, 65, 128]))
            ctx = P * int(rng.integers(0, 4)) + int(rng.choice([-1, 0, 1]))
            ctx = max(ctx, 0)
        q_lens.append(ql)
        seq_lens.append(ql + ctx)
    hq, hkv = [(8, 8), (16, 4), (28, 4), (32, 8)][seed % 4]
    _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=(64, 128)[seed % 2], seed=seed,
              pad_rows=int(rng.integers(0, 9)), force_split=bool(seed % 3 == 0),
              strided=bool(seed % 2))


@pytest.mark.gpu
def test_fused_plans_itself_and_refuses_a_paged_plan():
    from cute_kernels.attention import ion_attention, make_device_plan

    _run_case([1, 90, 1], [700, 90 + 33, 64], hq=16, hkv=4, d=128, use_api_plan=True)
    case = make_paged_case(0, [3], [70], 8, 2, 128, device="cuda")
    q, kc, vc, qsl, sl, bt = case
    key = torch.zeros(3, 2, 128, dtype=q.dtype, device="cuda")
    paged = make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=2, group_size=4, page_size=P,
                             head_dim=128, device="cuda")
    with pytest.raises(ValueError, match="fresh_kv"):
        ion_attention(q, kc, vc, torch.empty_like(q), qsl, sl, bt, 0.1, paged,
                      key=key, value=key)


@pytest.mark.gpu
def test_default_layer_in_a_cuda_graph():
    """The vLLM backend's default layer since the ninth session (fused writeback, the
    split-parallel combine, split-KV forced) captured once in a CUDA graph (always_combine)
    and replayed: on new q / key / value / cache values, then on new lengths planned into
    the same buffers.  Every replay writes the new K/V where the reference append puts
    them, bit for bit, and matches the reference attention on the updated cache."""
    from cute_kernels.attention import ion_attention

    from paged_gpu_checks import (
        capture_graph,
        check_out,
        forced_split_host_plan,
        poison,
        reusable_device_plan,
    )

    hq, hkv, d = 28, 4, 128
    g = hq // hkv
    q_lens, seq_lens = [1, 1, 1, 1, 300], [30000, 12000, 700, 20000, 2300]
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        7, q_lens, seq_lens, hq, hkv, d, page=P, device="cuda", rng_device="cuda")
    total_q = q.shape[0]
    key = torch.empty(total_q, hkv, d, dtype=q.dtype, device="cuda")
    value = torch.empty_like(key)
    scale = default_softmax_scale(d)

    def host_plan():
        return forced_split_host_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                                      fresh_kv=True)

    dp = reusable_device_plan(host_plan(), d, row_combine=True, lane_combine=True)
    assert dp.fresh_kv and dp.lane_combine
    gen = torch.Generator(device="cuda")
    gen.manual_seed(99)
    for t in (key, value):
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32))
    out = torch.empty_like(q)
    graph = capture_graph(lambda: ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale,
                                                plan=dp, key=key, value=value))
    for step in range(4):
        gen.manual_seed(1000 + step)
        for t in (q, k_cache, v_cache, key, value):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32))
        if step >= 2:
            # new decode lengths within each request's own pages (the block table's
            # columns past them point at random pages, which a write must not reach)
            new = [int(torch.randint(1, L + 1, (1,), generator=gen, device="cuda"))
                   for L in seq_lens[:4]] + [seq_lens[4]]
            sl.copy_(torch.tensor(new, dtype=sl.dtype))
            dp.upload(host_plan())
        assert dp.host.num_splits_max > 1, "split-KV not exercised"
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        slots = new_token_slot_mapping(qsl, sl, bt, P, total_q=total_q)
        reference_kv_append(key, value, ref_k, ref_v, slots)
        ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, scale)
        poison(dp, out)
        graph.replay()
        torch.cuda.synchronize()
        mask = written_rows_mask(qsl, sl, total_q).to(q.device)
        check_out(out, ref, mask, f"graph replay {step}")
        s = slots[slots >= 0].to("cuda")
        for got, want, name in ((k_cache, ref_k, "K"), (v_cache, ref_v, "V")):
            g_rows = got[s // P, :, s % P].view(torch.int16)
            w_rows = want[s // P, :, s % P].view(torch.int16)
            assert torch.equal(g_rows, w_rows), f"replay {step}: new {name} rows differ"
