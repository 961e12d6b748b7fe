"""GPU (sm_90) tests of the 192-row kernels (v17, an experiment): a ``tile_m=192`` plan runs
``IonAttentionSm90(consumers=3)``, three consumer warpgroups on one 512-thread CTA per SM,
sharing every K/V stage (4 stages of 64-token pages).

Checked on fresh random inputs (``out`` NaN-poisoned first; rows without work must stay
NaN) against the fp32 reference, and against the same batch through the default 128-row
plan: mixed batches (decode rows, chunks whose context is not a page multiple, rows with 0
new tokens, padded rows, 192-row boundaries), G = 7, 8 and 1, D 64/128, bf16/fp16, packed
and unpacked prefill tiles; forced split-KV (partial rows of the third warpgroup); the
anchor prefill shape, shortened.  Fused writeback (``key``/``value``): the output as above
and the cache bit-equal to the reference append at every position < seq_len.
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
#: new-token counts around the 192-row (and 64/128-row) tile boundaries
BOUNDARY_Q_192 = (1, 8, 23, 24, 25, 63, 64, 65, 127, 128, 129, 191, 192, 193, 383, 384, 385)


def _device_plan(qsl, sl, hkv, g, d, *, tile_m, force_split=False, unpacked=True,
                 fresh_kv=False):
    return device_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, unpacked_prefill=unpacked, tile_m=tile_m,
                       lane_combine=True, fresh_kv=fresh_kv)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         unpacked=True):
    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    p3 = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=192,
                      force_split=force_split, unpacked=unpacked)
    assert p3.consumers == 3 and p3.tile_m == 192 and p3.host.tile_m == 192
    if force_split:
        assert p3.host.num_splits_max > 1, "split-KV not exercised"
    out3 = launch_checked(case, p3, "tile_m=192 plan")
    p2 = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=128,
                      force_split=force_split, unpacked=unpacked)
    out2 = launch_checked(case, p2, "tile_m=128 plan")
    check_agree(out3, out2, case.mask, "192 rows vs 128")
    return p3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_192_rows_match_reference(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(13 * hq + d + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=P,
                                              long_ctx=(0, 1, 37, 64, 100, 1000),
                                              boundary_q=BOUNDARY_Q_192)
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=300 + trial,
             pad_rows=(5 if trial == 1 else 0), unpacked=trial != 2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_192_rows_split_kv(heads):
    hq, hkv = heads
    # packed tiles that split (decode rows, short chunks) under a split-friendly cost model;
    # a 200-token chunk over 2500 cached tokens fills the third warpgroup's rows
    q_lens = [1, 1, 1, 256, 0, 129, 1, 200]
    seq_lens = [150, 300, 560, 256 + 37, 77, 129 + 1, 3000, 200 + 2500]
    p = _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=23,
             pad_rows=3, force_split=True, unpacked=False)
    w = p.host.work
    assert (w[:, 7] > 1).any()


@pytest.mark.gpu
def test_192_rows_long_prefill_g7():
    # the anchor shape (28 q / 4 KV heads, d 128), shortened (2048 = 10 2/3 tiles of 192),
    # a decode row beside
    p = _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=17)
    assert (p.host.work[:, 8] >= 0).any(), "no unpacked prefill item"


@pytest.mark.gpu
@pytest.mark.parametrize("force_split", [False, True], ids=["plain", "split"])
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
def test_192_rows_fused_writeback(unpacked, force_split):
    hq, hkv, d, dtype = 28, 4, 128, torch.bfloat16
    g = hq // hkv
    # contexts 37, 0, 1 and 70 (fresh tiles straddle pages), decode rows, a row with 0 new
    # tokens, chunks of 1-7 fresh tiles, 192-row boundaries, a 3000-token decode row (the
    # one that splits under the split-friendly cost model)
    q_lens = [1, 256, 0, 192, 3, 64, 130, 1, 385, 1]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1, 130 + 70, 150, 385 + 1, 3000]
    case = fused_reference_case(51 + unpacked + 2 * force_split, 52 + unpacked + 2 * force_split,
                                q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                                pad_rows=2)
    dp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=192,
                      unpacked=unpacked, fresh_kv=True, force_split=force_split)
    assert dp.fresh_kv and dp.consumers == 3
    if force_split:
        assert (dp.host.work[:, 7] > 1).any(), "split-KV not exercised"
    launch_fused_checked(case, dp, "fused, 192 rows")
