"""GPU (sm_90) tests of the two-consumer-warpgroup kernel: a ``tile_m=128`` plan
(``make_device_plan(..., tile_m=128)`` / ``DevicePlan(tile_m=128)``) makes ``ion_attention``
launch ``IonAttentionSm90(consumers=2)``: 128-row q tiles, consumer warpgroups 1/2 compute
rows 0-63 / 64-127 and share every K/V stage, one 384-thread CTA per SM (num_ctas = SMs).

Checked on fresh random mixed batches (decode rows, prefill chunks whose cached prefix is not
a page multiple, rows with 0 new tokens, padded token rows, long rows whose second half-tile
is partly or wholly empty), G = 7 (28/4 heads), 8 (32/4) and 1 (4/4), D 64/128, bf16/fp16:
* vs the fp32 reference: rel err <= 1e-2 on every row with work, no NaN; ``out`` is
  NaN-poisoned first and rows without work stay NaN;
* the same batch through a tile_m=64 plan (default kernel) agrees to <= 1e-2;
* split-KV items of 128-row tiles (combine pass, partial rows 64..127 from consumer 2);
* unpacked prefill tiles (one q head x 128 tokens) and fused KV writeback with consumers=2.
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
#: this file's long-chunk contexts (its random cases predate the 128-token-page ones)
LONG_CTX_64 = (0, 1, 37, 64, 100, 1000)


def _device_plan(qsl, sl, hkv, g, d, *, tile_m, force_split=False, unpacked=False,
                 fresh_kv=False):
    return device_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, fresh_kv=fresh_kv, unpacked_prefill=unpacked,
                       tile_m=tile_m)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         unpacked=False):
    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    p128 = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=128, force_split=force_split,
                        unpacked=unpacked)
    assert p128.tile_m == 128 and p128.consumers == 2
    if force_split:
        assert p128.host.num_splits_max > 1, "split-KV not exercised"
    out2 = launch_checked(case, p128, "tile_m=128 plan (consumers=2)")
    p64 = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=64)
    out1 = launch_checked(case, p64, "tile_m=64 plan")
    check_agree(out2, out1, case.mask, "tile_m 128 vs 64")
    return p128


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_tile_m_128_matches_reference(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(hq * 1000 + d + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=P,
                                              long_ctx=LONG_CTX_64)
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=trial,
             pad_rows=(5 if trial == 1 else 0))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_tile_m_128_split_kv(heads):
    hq, hkv = heads
    # long decode rows and a long chunk get split-KV: consumer 2 writes partial rows 64..127
    q_lens = [1, 256, 1, 0, 129, 64, 200]
    seq_lens = [3000, 256 + 37, 1500, 77, 129 + 1, 64 + 640, 200 + 2500]
    p = _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=7,
             pad_rows=3, force_split=True)
    w = p.host.work
    assert ((w[:, 7] > 1) & (w[:, 3] * (1 << (hq // hkv - 1).bit_length()) > 64)).any(), \
        "no split item with rows in the second consumer's half"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_tile_m_128_unpacked_prefill_g7(d):
    from cute_kernels.planner import W_QHEAD

    p = _run([1, 512, 0, 300, 256], [700, 512 + 37, 50, 300 + 64, 256], hq=28, hkv=4, d=d,
             dtype=torch.bfloat16, seed=5, pad_rows=2, unpacked=True)
    assert (p.host.work[:, W_QHEAD] >= 0).any()


@pytest.mark.gpu
def test_long_prefill_g7():
    # the benchmark shape (28 q / 4 KV heads, d 128), shortened
    _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
def test_tile_m_128_fused_writeback(unpacked):
    hq, hkv, d, dtype = 28, 4, 128, torch.bfloat16
    g = hq // hkv
    q_lens = [1, 256, 0, 192, 3, 64, 130]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1, 130 + 70]
    case = fused_reference_case(11, 12, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype,
                                page=P, pad_rows=2)
    dp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, tile_m=128,
                      unpacked=unpacked, fresh_kv=True)
    launch_fused_checked(case, dp, "fused, tile_m=128")
