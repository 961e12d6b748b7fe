"""GPU (sm_90) tests of the row-parallel split-KV combine (``CombineRowsSm90``, selected by
``make_device_plan(..., row_combine=True)`` / the backend's ``ION_ROW_COMBINE=1``).

On batches planned with cheap splitting (so most tiles split, up to 16 ways), against the
fp32 reference and against the default combine on the same plan:
* few long decode rows (8 x 32k-like, the case the kernel exists for), mixed batches with
  split prefill chunks (groups of up to 64 or 128 rows), padded token rows and rows
  without work (must stay NaN), G = 7 / 8 / 1, D 64 / 128, bf16 / fp16, tile_m 64 / 128;
* the same plan replayed on a second, smaller batch: the combine must stop at the new
  batch's last group (stale group rows are zeroed by the upload), never reuse old rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)

from paged_gpu_checks import (
    HEAD_IDS,
    HEADS,
    TOL,
    check_out,
    forced_split_host_plan,
    forced_split_plan,
    reusable_device_plan,
)

P = 64


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, tile_m=64, pad_rows=0):
    from cute_kernels.attention import ion_attention

    g = hq // hkv
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=P, dtype=dtype, device="cuda",
        pad_rows=pad_rows)
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0]).to(q.device)
    qsl_h, sl_h = qsl.cpu().numpy(), sl.cpu().numpy()
    outs = {}
    for rows in (True, False):
        plan = forced_split_plan(qsl_h, sl_h, hkv=hkv, group_size=g, head_dim=d, page=P,
                                 tile_m=tile_m, row_combine=rows)
        assert plan.row_combine is rows
        assert plan.host.num_splits_max > 1, "split-KV not exercised"
        out = torch.full_like(q, float("nan"))
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=plan)
        outs[rows] = out
    torch.cuda.synchronize()
    for rows, out in outs.items():
        check_out(out, ref, mask, "row combine" if rows else "default combine")
    diff = relative_error(outs[True], outs[False].float(), mask)
    assert diff <= 1e-3, f"row vs default combine differ: {diff:.3e}"  # same math, fp32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_few_long_decode_rows(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(hq + d)
    seq_lens = [int(x) for x in rng.integers(6000, 12000, size=4)]
    _run([1] * 4, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=hq * d, pad_rows=3)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_mixed_batches_with_split_chunks(heads, tile_m):
    hq, hkv = heads
    rng = np.random.default_rng(7 * hq + tile_m)
    for trial in range(3):
        q_lens, seq_lens = [], []
        for _ in range(int(rng.integers(3, 9))):
            kind = int(rng.integers(0, 4))
            if kind == 0:
                ql, L = 1, int(rng.integers(1, 9000))
            elif kind == 1:
                ql = int(rng.integers(2, 300))
                L = ql + int(rng.integers(1, 6000))
            elif kind == 2:
                ql, L = 0, int(rng.integers(0, 500))
            else:
                ql = int(rng.integers(64, 400))
                L = ql + int(rng.integers(0, 3000))
            q_lens.append(ql)
            seq_lens.append(L)
        q_lens[0], seq_lens[0] = 1, 7000  # at least one splittable row
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=trial,
             tile_m=tile_m, pad_rows=2 * trial)


@pytest.mark.gpu
def test_reused_buffers_stop_at_the_new_last_group():
    """A big split plan, then a smaller one uploaded into the same DevicePlan: the row
    combine must merge only the new groups (the stale ones were zeroed)."""
    from cute_kernels.attention import ion_attention

    hq, hkv, d = 28, 4, 128
    dp = None
    for q_lens, seq_lens, seed in (([1] * 8, [9000] * 8, 1), ([1, 1], [5000, 300], 2)):
        q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
            seed, q_lens, seq_lens, hq, hkv, d, page=P, device="cuda")
        hp = forced_split_host_plan(qsl, sl, hkv=hkv, group_size=7, head_dim=d, page=P)
        if dp is None:
            dp = reusable_device_plan(hp, d, row_combine=True)
        else:
            dp.upload(hp)
        out = torch.full_like(q, float("nan"))
        scale = default_softmax_scale(d)
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=dp)
        torch.cuda.synchronize()
        ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
        mask = written_rows_mask(qsl, sl, q.shape[0]).to(q.device)
        assert relative_error(out, ref, mask) <= TOL
        assert not torch.isnan(out[mask]).any()
