"""GPU (sm_90) tests of the split-parallel split-KV combine (``CombineLanesSm90``, plans with
``lane_combine=True``; the backend's ``ION_LANE_COMBINE=1``).

On plans with cheap splitting (most tiles split), NaN-poisoned outputs and workspace,
against the fp32 reference and against the row combine on the same plan (same math in fp32,
different summation order):
* few long decode rows with up to 8 splits (one chunk of loads) and up to 16 (two chunks),
  G = 7 / 8 / 1, D 64 / 128, bf16 / fp16;
* mixed batches with split prefill chunks at tile_m 64 and 128, padded rows;
* ``max_splits=40`` on very long rows: splits past the 32 lanes take the kernel's slow
  path, which must merge them exactly too.
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
    check_out,
    forced_split_plan,
    mixed_batch_with_long_decode,
    poison,
)

P = 64


def _run(q_lens, seq_lens, *, hq, hkv, d=128, dtype=torch.bfloat16, seed, tile_m=64,
         pad_rows=0, max_splits=16, min_splits=2):
    from cute_kernels.attention import ion_attention

    g = hq // hkv
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=P, dtype=dtype, device="cuda",
        pad_rows=pad_rows, rng_device="cuda")
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0]).to(q.device)
    outs = {}
    for lanes in (True, False):
        plan = forced_split_plan(qsl.cpu().numpy(), sl.cpu().numpy(), hkv=hkv, group_size=g,
                                 head_dim=d, page=P, tile_m=tile_m, max_splits=max_splits,
                                 row_combine=True, lane_combine=lanes)
        assert plan.lane_combine is lanes
        assert plan.host.num_splits_max >= min_splits, plan.host.num_splits_max
        out = torch.empty_like(q)
        poison(plan, out)
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=plan)
        torch.cuda.synchronize()
        check_out(out, ref, mask, "lane combine" if lanes else "row combine")
        outs[lanes] = out
    diff = relative_error(outs[True], outs[False].float(), mask)
    assert diff <= 1e-3, f"lane vs row combine differ: {diff:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_long_decode_rows(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(hq + d)
    seq_lens = [int(x) for x in rng.integers(6000, 40000, size=4)]
    _run([1] * 4, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=hq * d, pad_rows=3,
         min_splits=9)  # more than one chunk of SPLITS_IN_FLIGHT


@pytest.mark.gpu
@pytest.mark.parametrize("max_splits", [2, 5, 8])
def test_one_chunk(max_splits):
    _run([1] * 3, [20000, 9000, 3000], hq=28, hkv=4, seed=max_splits, max_splits=max_splits,
         min_splits=max_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
def test_mixed_batches(tile_m):
    rng = np.random.default_rng(300 + tile_m)
    for trial in range(4):
        q_lens, seq_lens = mixed_batch_with_long_decode(rng, trial, page=P)
        _run(q_lens, seq_lens, hq=28, hkv=4, seed=trial, tile_m=tile_m, pad_rows=trial)


@pytest.mark.gpu
def test_more_splits_than_lanes():
    """max_splits=40: rows split up to 40 ways; splits 32.. reload their lse (slow path)."""
    _run([1, 1], [64 * 1000, 64 * 700 + 5], hq=28, hkv=4, seed=9, max_splits=40,
         min_splits=33)
