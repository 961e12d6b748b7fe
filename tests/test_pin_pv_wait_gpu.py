"""GPU (sm_90) tests of the pinned PV wait (``IonAttentionSm90(pin_pv_wait=True)``: the
steady state's wait for its previous O += P V sits after the softmax in the SASS, inside a
branch on the row sum whose two arms both wait).

A wait in the wrong place reads O or reuses P registers while a wgmma still uses them, so
every test checks, on fresh random inputs (``out`` NaN-poisoned first; rows without work
must stay NaN), the pinned plan against the fp32 reference and against the same batch
through a plan without the option: mixed batches (decode rows, chunks whose context is not
a page multiple, rows with 0 new tokens, padded rows) on 64- and 128-row tiles, G = 7, 8
and 1, D 64/128, bf16/fp16; forced split-KV; page pairs and ping-pong with it; and fused
writeback on both tile sizes with the cache bit-equal to the reference append.
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


def _plan(case, hkv, g, d, *, pin, tile_m, force_split=False, fresh_kv=False, **extra):
    return device_plan(case.qsl_h, case.sl_h, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, unpacked_prefill=True, tile_m=tile_m,
                       lane_combine=True, pin_pv_wait=pin, fresh_kv=fresh_kv, **extra)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, tile_m, pad_rows=0,
         force_split=False, **extra):
    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    pinned = _plan(case, hkv, g, d, pin=True, tile_m=tile_m, force_split=force_split,
                   **extra)
    from cute_kernels.attention import PIN_PV_WAIT_DEFAULT

    # the plan asks for the pinned kernels (None when they are the default)
    assert pinned.pin_pv_wait is (None if PIN_PV_WAIT_DEFAULT else True)
    if force_split:
        assert pinned.host.num_splits_max > 1, "split-KV not exercised"
    out_pin = launch_checked(case, pinned, f"tile_m={tile_m}, pinned PV wait")
    plain = _plan(case, hkv, g, d, pin=False, tile_m=tile_m, force_split=force_split,
                  **extra)
    out_plain = launch_checked(case, plain, f"tile_m={tile_m}, default PV wait")
    check_agree(out_pin, out_plain, case.mask, "pinned vs default")
    return pinned


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_pinned_wait_matches_reference(heads, d, dtype, tile_m):
    hq, hkv = heads
    rng = np.random.default_rng(17 * hq + d + tile_m + (dtype == torch.float16))
    for trial in range(2):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial, page=P,
                                              long_ctx=(0, 1, 37, 64, 100, 1000))
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=400 + trial,
             tile_m=tile_m, pad_rows=(5 if trial == 1 else 0))


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
def test_pinned_wait_split_kv(tile_m):
    q_lens = [1, 1, 1, 256, 0, 129, 1, 200]
    seq_lens = [150, 300, 560, 256 + 37, 77, 129 + 1, 3000, 200 + 2500]
    p = _run(q_lens, seq_lens, hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=37,
             tile_m=tile_m, pad_rows=3, force_split=True)
    assert (p.host.work[:, 7] > 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{"kv_pair": True}, {"pingpong": True}],
                         ids=["kv_pair", "pingpong"])
def test_pinned_wait_with_the_128_row_experiments(extra):
    _run([2048, 1, 130], [2148, 500, 200], hq=28, hkv=4, d=128, dtype=torch.bfloat16,
         seed=41, tile_m=128, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128])
def test_pinned_wait_fused_writeback(tile_m):
    hq, hkv, d, dtype = 28, 4, 128, torch.bfloat16
    q_lens = [1, 256, 0, 192, 3, 64, 130, 1]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1, 130 + 70, 150]
    s = 61 + tile_m
    case = fused_reference_case(s, s + 1, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype,
                                page=P, pad_rows=2)
    dp = _plan(case, hkv, hq // hkv, d, pin=True, tile_m=tile_m, fresh_kv=True)
    assert dp.fresh_kv
    launch_fused_checked(case, dp, f"fused, tile_m={tile_m}, pinned PV wait")
