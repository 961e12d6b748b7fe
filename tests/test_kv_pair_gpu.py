"""GPU (sm_90) tests of page pairs: a ``tile_m=128`` plan made with ``kv_pair=True`` makes
``ion_attention`` launch ``IonAttentionSm90(consumers=2, kv_pair=True)``, whose K/V stages
hold two 64-token pages (128-key S tiles; an odd last page of an item goes into both halves
and the copy is masked).

Checked on fresh random inputs (``out`` NaN-poisoned first; rows without work must stay
NaN) against the fp32 reference, and against the same batch through the pair-less
``tile_m=128`` plan: mixed batches (decode rows, chunks whose context is not a page
multiple, rows with 0 new tokens, padded rows), G = 7, 8 and 1, D 64/128, bf16/fp16;
forced split-KV with odd page counts per split (the duplicate-half path inside splits);
unpacked prefill tiles; the anchor prefill shape, shortened.  Fused writeback on pairs
(``key``/``value`` given): the output as above and the cache bit-equal to the reference
append at every position < seq_len, with prefill chunks whose context is not a page
multiple (fresh tiles straddling two pages, in either half of a stage).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch


from paged_gpu_checks import (
    HEAD_IDS,
    HEADS,
    check_agree,
    device_plan,
    fused_reference_case,
    launch_checked,
    launch_fused_checked,
    random_mixed_batch,
    reference_case,
)

P = 64


def _device_plan(qsl, sl, hkv, g, d, *, kv_pair, force_split=False, unpacked=True,
                 fresh_kv=False):
    return device_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, unpacked_prefill=unpacked, tile_m=128,
                       lane_combine=True, kv_pair=kv_pair, fresh_kv=fresh_kv)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         unpacked=True):
    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    pp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, kv_pair=True, force_split=force_split,
                      unpacked=unpacked)
    assert pp.kv_pair and pp.consumers == 2
    if force_split:
        assert pp.host.num_splits_max > 1, "split-KV not exercised"
    out2 = launch_checked(case, pp, "kv_pair plan")
    p1 = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, kv_pair=False,
                      force_split=force_split, unpacked=unpacked)
    out1 = launch_checked(case, p1, "tile_m=128 plan without pairs")
    check_agree(out2, out1, case.mask, "pairs vs no pairs")
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


@pytest.mark.gpu
@pytest.mark.parametrize("force_split", [False, True], ids=["plain", "split"])
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
def test_kv_pair_fused_writeback(unpacked, force_split):
    hq, hkv, d, dtype = 28, 4, 128, torch.bfloat16
    g = hq // hkv
    # contexts 37, 0, 1 and 70 (fresh tiles straddle pages), 3-page decode rows, a row with
    # 0 new tokens, a chunk of 3 fresh tiles (odd: the last stage holds a copy)
    q_lens = [1, 256, 0, 192, 3, 64, 130, 1]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1, 130 + 70, 150]
    case = fused_reference_case(21 + unpacked + 2 * force_split, 22 + unpacked + 2 * force_split,
                                q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                                pad_rows=2)
    dp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, kv_pair=True,
                      unpacked=unpacked, fresh_kv=True, force_split=force_split)
    assert dp.kv_pair and dp.fresh_kv
    w = dp.host.work
    assert ((w[:, 5] - w[:, 4]) % 2 == 1).any(), "no odd unit count"
    if force_split:
        assert (w[:, 7] > 1).any(), "split-KV not exercised"
    launch_fused_checked(case, dp, "fused, kv_pair")
