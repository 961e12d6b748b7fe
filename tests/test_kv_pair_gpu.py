"""GPU (sm_90) tests of page pairs: a ``tile_m=128`` plan made with ``kv_pair=True`` makes
``ion_attention`` launch ``IonAttentionSm90(consumers=2, kv_pair=True)``, whose K/V stages
hold two 64-token pages (128-key S tiles; an odd last page of an item goes into both halves
and the copy is masked).

Checked on fresh random inputs (``out`` NaN-poisoned first; rows without work must stay
NaN) against the fp32 reference, and against the same batch through the pair-less
``tile_m=128`` plan: mixed batches (decode rows, chunks whose context is not a page
multiple, rows with 0 new tokens, padded rows), G = 7, 8 and 1, D 64/128, bf16/fp16;
forced split-KV with odd page counts per split (the duplicate-half path inside splits);
unpacked prefill tiles; the anchor prefill shape, shortened.
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

from paged_gpu_checks import CHEAP_SPLIT, HEAD_IDS, HEADS, TOL, random_mixed_batch
from paged_gpu_checks import check_out as _check_out

P = 64


def _device_plan(qsl, sl, hkv, g, d, *, kv_pair, force_split=False, unpacked=True):
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=d, **CHEAP_SPLIT) if force_split else CostModel(head_dim=d)
    return make_device_plan(qsl, sl, num_kv_heads=hkv, group_size=g, page_size=P, head_dim=d,
                            device="cuda", unpacked_prefill=unpacked, tile_m=128,
                            cost_model=cm, lane_combine=True, kv_pair=kv_pair)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         unpacked=True):
    from cute_kernels.attention import ion_attention

    g = hq // hkv
    case = make_paged_case(seed, q_lens, seq_lens, hq, hkv, d, page=P, dtype=dtype,
                           device="cuda", pad_rows=pad_rows)
    q, k_cache, v_cache, qsl, sl, bt = case
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k_cache, v_cache, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0])
    qsl_h, sl_h = qsl.cpu().numpy(), sl.cpu().numpy()

    pp = _device_plan(qsl_h, sl_h, hkv, g, d, kv_pair=True, force_split=force_split,
                      unpacked=unpacked)
    assert pp.kv_pair and pp.consumers == 2
    if force_split:
        assert pp.host.num_splits_max > 1, "split-KV not exercised"
    out2 = torch.full_like(q, float("nan"))
    ion_attention(q, k_cache, v_cache, out2, qsl, sl, bt, scale, plan=pp)

    p1 = _device_plan(qsl_h, sl_h, hkv, g, d, kv_pair=False, force_split=force_split,
                      unpacked=unpacked)
    out1 = torch.full_like(q, float("nan"))
    ion_attention(q, k_cache, v_cache, out1, qsl, sl, bt, scale, plan=p1)
    torch.cuda.synchronize()

    _check_out(out2, ref, mask, "kv_pair plan")
    _check_out(out1, ref, mask, "tile_m=128 plan without pairs")
    agree = relative_error(out2, out1.float(), mask)
    assert agree <= TOL, f"pairs vs no pairs: rel diff {agree:.3e}"
    return pp


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_kv_pair_matches_reference(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(7 * hq + d + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=P,
                                              long_ctx=(0, 1, 37, 64, 100, 1000))
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=100 + trial,
             pad_rows=(5 if trial == 1 else 0), unpacked=trial != 2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_kv_pair_split_kv_with_odd_pages(heads):
    hq, hkv = heads
    # decode rows of 3, 5 and 9 pages and long rows under a split-friendly cost model: split
    # items with odd page counts (the last stage of a split holds its last page twice)
    q_lens = [1, 1, 1, 256, 0, 129, 1, 200]
    seq_lens = [150, 300, 560, 256 + 37, 77, 129 + 1, 3000, 200 + 2500]
    p = _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=9,
             pad_rows=3, force_split=True)
    w = p.host.work
    assert ((w[:, 7] > 1) & ((w[:, 5] - w[:, 4]) % 2 == 1)).any(), "no odd split item"
    assert ((w[:, 5] - w[:, 4]) % 2 == 0).any()


@pytest.mark.gpu
def test_kv_pair_long_prefill_g7():
    # the anchor shape (28 q / 4 KV heads, d 128), shortened; an odd-page decode row beside
    p = _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=3)
    assert (p.host.work[:, 8] >= 0).any(), "no unpacked prefill item"
