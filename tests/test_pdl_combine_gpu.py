"""GPU (sm_90) tests of the split-KV combine launched by programmatic dependent launch
(``make_device_plan(..., pdl_combine=True)``; the backend's ``ION_PDL_COMBINE=1``).

The combine grid may start while the attention grid still runs (the attention kernel
triggers ``griddepcontrol.launch_dependents`` at its start); only its
``griddepcontrol.wait`` keeps it from reading partials that are not written yet.  So every
check poisons the split-KV workspace with NaN before the launch (a partial read too early is
NaN or stale, never the right value), uses long splits (the attention grid runs long after
the combine is scheduled), and compares the output with the non-PDL combine on the same
plan, bit for bit, and with the fp32 reference.  The same holds under CUDA-graph capture
and replay, with new data and a new plan uploaded between replays.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    reference_paged_attention,
    written_rows_mask,
)

from paged_gpu_checks import (
    HEAD_IDS,
    HEADS,
    capture_graph,
    check_out,
    forced_split_host_plan,
    forced_split_plan,
    mixed_batch_with_long_decode,
    poison,
    reusable_device_plan,
)

P = 64


def _same_bits(a, b, mask):
    m = mask.to(a.device)
    return torch.equal(a[m].view(torch.int16), b[m].view(torch.int16))


def _run(q_lens, seq_lens, *, hq, hkv, d=128, seed, tile_m=64, pad_rows=0, repeats=3):
    from cute_kernels.attention import ion_attention

    g = hq // hkv
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=P, device="cuda", pad_rows=pad_rows,
        rng_device="cuda")
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0]).to(q.device)
    qsl_h, sl_h = qsl.cpu().numpy(), sl.cpu().numpy()
    outs = {}
    for pdl in (False, True):
        plan = forced_split_plan(qsl_h, sl_h, hkv=hkv, group_size=g, head_dim=d, page=P,
                                 tile_m=tile_m, row_combine=True, pdl_combine=pdl)
        assert plan.pdl_combine is pdl
        assert plan.host.num_splits_max > 1, "split-KV not exercised"
        out = torch.empty_like(q)
        for _ in range(repeats):  # back to back: each combine queued behind its attention
            poison(plan, out)
            ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=plan)
            torch.cuda.synchronize()
            check_out(out, ref, mask, f"pdl={pdl}")
            if pdl:
                assert _same_bits(out, outs[False], mask), "PDL combine differs from the default"
        outs[pdl] = out.clone()


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_long_splits_against_default_combine(heads):
    hq, hkv = heads
    rng = np.random.default_rng(hq)
    seq_lens = [int(x) for x in rng.integers(20000, 40000, size=6)]
    _run([1] * 6, seq_lens, hq=hq, hkv=hkv, seed=hq, pad_rows=3)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
def test_mixed_batches(tile_m):
    rng = np.random.default_rng(100 + tile_m)
    for trial in range(4):
        q_lens, seq_lens = mixed_batch_with_long_decode(rng, trial, page=P)
        _run(q_lens, seq_lens, hq=28, hkv=4, seed=trial, tile_m=tile_m, pad_rows=trial)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Captured once (always_combine), replayed on new K/V/q values and on a new plan with
    other lengths uploaded into the same buffers: every replay matches the reference."""
    from cute_kernels.attention import ion_attention

    hq, hkv, d = 28, 4, 128
    g = hq // hkv
    q_lens, seq_lens = [1, 1, 1, 1, 300], [30000, 12000, 700, 20000, 2300]
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        5, q_lens, seq_lens, hq, hkv, d, page=P, device="cuda", rng_device="cuda")
    scale = default_softmax_scale(d)

    def host_plan():
        return forced_split_host_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P)

    dp = reusable_device_plan(host_plan(), d, row_combine=True, pdl_combine=True)
    out = torch.empty_like(q)
    graph = capture_graph(
        lambda: ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=dp))
    gen = torch.Generator(device="cuda")
    for step in range(4):
        gen.manual_seed(1000 + step)
        for t in (q, k_cache, v_cache):
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32))
        if step >= 2:  # other lengths (same q rows), same buffers, same graph
            new = torch.tensor([int(x) for x in
                                torch.randint(1, 30000, (4,), generator=gen, device="cuda")]
                               + [300 + step], dtype=sl.dtype)
            sl.copy_(new.to(sl.device))
            dp.upload(host_plan())
        assert dp.host.num_splits_max > 1
        poison(dp, out)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
        mask = written_rows_mask(qsl, sl, q.shape[0]).to(q.device)
        check_out(out, ref, mask, f"graph replay {step}")
