"""GPU (sm_90) tests of 128-token pages (``ion_attention(..., experimental_pages=True)``):
128-row K/V tiles, one CTA per SM, on 64-row (one consumer warpgroup) and 128-row (two)
q tiles, packed and unpacked prefill tiles, with and without split-KV. Fresh random mixed
batches (decode rows, chunks whose cached prefix is not a page multiple, 0-token rows,
padded token rows, page-boundary lengths) against the fp32 reference; ``out`` is
NaN-poisoned first. Also the refusals: a 128-page cache without the opt-in, a plan of the
other page size, and fused writeback on 128-token pages."""
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
from paged_gpu_checks import CHEAP_SPLIT, HEAD_IDS, HEADS, check_out, random_mixed_batch

P = 128


def _plan(qsl_h, sl_h, hkv, g, d, *, tile_m, page=P, force_split=False, unpacked=False):
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=d, **CHEAP_SPLIT) if force_split else CostModel(head_dim=d)
    return make_device_plan(qsl_h, sl_h, num_kv_heads=hkv, group_size=g, page_size=page,
                            head_dim=d, device="cuda", unpacked_prefill=unpacked,
                            tile_m=tile_m, cost_model=cm)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, tile_m, pad_rows=0,
         force_split=False, unpacked=False):
    from cute_kernels.attention import ion_attention

    g = hq // hkv
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        seed, q_lens, seq_lens, hq, hkv, d, page=P, dtype=dtype, device="cuda",
        pad_rows=pad_rows)
    assert k_cache.shape[2] == P
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0])
    plan = _plan(qsl.cpu().numpy(), sl.cpu().numpy(), hkv, g, d, tile_m=tile_m,
                 force_split=force_split, unpacked=unpacked)
    assert plan.page_size == P
    if force_split:
        assert plan.host.num_splits_max > 1, "split-KV not exercised"
    out = torch.full_like(q, float("nan"))
    ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=plan,
                  experimental_pages=True)
    torch.cuda.synchronize()
    check_out(out, ref, mask, f"128-token pages, tile_m={tile_m}, unpacked={unpacked}")
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_page128_matches_reference(heads, d, dtype, tile_m):
    hq, hkv = heads
    rng = np.random.default_rng(hq * 1000 + d * 10 + tile_m + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=P)
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=trial, tile_m=tile_m,
             pad_rows=(5 if trial == 1 else 0), unpacked=(tile_m == 128 or trial == 2))


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_page128_split_kv(heads, tile_m):
    hq, hkv = heads
    q_lens = [1, 256, 1, 0, 129, 64, 200]
    seq_lens = [3000, 256 + 37, 1500, 77, 129 + 1, 64 + 640, 200 + 2500]
    _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=7,
         tile_m=tile_m, pad_rows=3, force_split=True, unpacked=(tile_m == 128))


@pytest.mark.gpu
def test_page128_long_prefill_g7():
    # the prefill anchor's shape (28 q / 4 KV heads, d 128), shortened; a causal diagonal
    # that cuts 128-row tiles at every offset of the 64-row q tiles
    _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=3,
         tile_m=128, unpacked=True)
    _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=4,
         tile_m=64)


@pytest.mark.gpu
def test_page128_refusals():
    from cute_kernels.attention import ion_attention

    hq, hkv, d = 28, 4, 128
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(
        1, [1, 100], [300, 100], hq, hkv, d, page=P, dtype=torch.bfloat16, device="cuda")
    scale = default_softmax_scale(d)
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="experimental"):
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale)
    p64 = _plan(qsl.cpu().numpy(), sl.cpu().numpy(), hkv, hq // hkv, d, tile_m=64, page=64)
    with pytest.raises(ValueError, match="64-token pages, the cache has 128"):
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, plan=p64,
                      experimental_pages=True)
    key = torch.randn(q.shape[0], hkv, d, device="cuda", dtype=q.dtype)
    with pytest.raises(ValueError, match="fused KV writeback needs 64-token pages"):
        ion_attention(q, k_cache, v_cache, out, qsl, sl, bt, scale, key=key, value=key,
                      experimental_pages=True)
    assert torch.isnan(out).all(), "a refused call must not launch"
