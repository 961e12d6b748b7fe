"""GPU (sm_90) tests of unpacked prefill q tiles: ``make_device_plan(...,
unpacked_prefill=True)`` tiles long prefill rows of padded GQA groups (G < Gp) one q head x
64 tokens per item (work col 8 >= 0) and ``ion_attention`` runs the
``IonAttentionSm90(unpacked_prefill=True)`` variant, which serves the packed items (decode,
short rows, split-KV) of the same launch as well.

Checked on fresh random mixed batches (decode rows, prefill chunks whose cached prefix is not
a page multiple, rows with 0 new tokens, padded token rows, long rows), G = 7 (28/4 heads),
G = 3 (12/4) and G = 8 (no padding: stays packed), D 64/128, bf16/fp16:
* vs the fp32 reference: rel err <= 1e-2 on every row with work, no NaN; ``out`` is
  NaN-poisoned first and rows without work stay NaN;
* the same rows computed with a packed plan agree with the unpacked plan to <= 1e-2;
* split-KV forced on the packed items of an unpacked plan (combine path);
* fused KV writeback together with unpacked tiles (owner of a fresh tile: q head 0).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch


from paged_gpu_checks import (
    check_agree,
    device_plan,
    fused_reference_case,
    launch_checked,
    launch_fused_checked,
    random_mixed_batch,
    reference_case,
)

P = 64


def _random_batch(rng, n_long):
    """Mixed batch with ``n_long`` long prefill rows (q a multiple of 64, so they are
    unpacked for G = 7 and G = 3) among decode / chunk / empty rows."""
    return random_mixed_batch(rng, n_long, P, long_ctx=(0, 1, 37, 64, 100, 1000),
                              boundary_q=(1, 63, 64, 65, 128),
                              long_q=lambda r: 64 * int(r.integers(2, 9)))


def _device_plan(qsl, sl, hkv, g, d, *, unpacked, force_split=False, fresh_kv=False):
    return device_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, fresh_kv=fresh_kv, unpacked_prefill=unpacked)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         expect_unpacked=True):
    from cute_kernels.planner import W_QHEAD

    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    pu = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, unpacked=True, force_split=force_split)
    assert pu.unpacked
    n_unp = int((pu.host.work[:, W_QHEAD] >= 0).sum())
    assert (n_unp > 0) == expect_unpacked, (n_unp, q_lens, seq_lens)
    if force_split:
        assert pu.host.num_splits_max > 1, "split-KV not exercised"
    out_u = launch_checked(case, pu, "unpacked plan")
    pp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, unpacked=False, force_split=force_split)
    assert not pp.unpacked
    out_p = launch_checked(case, pp, "packed plan")
    check_agree(out_u, out_p, case.mask, "packed vs unpacked plan")
    return n_unp


HEADS = [(28, 4), (12, 4), (32, 4)]  # G = 7, 3, 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=["g7", "g3", "g8"])
def test_unpacked_plan_matches_reference_and_packed(heads, d, dtype):
    hq, hkv = heads
    g = hq // hkv
    rng = np.random.default_rng(hq * 1000 + d + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = _random_batch(rng, n_long=1 + trial % 2)
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=trial,
             pad_rows=(5 if trial == 1 else 0), expect_unpacked=(g != 8))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS[:2], ids=["g7", "g3"])
def test_unpacked_plan_with_forced_split_of_packed_items(heads):
    hq, hkv = heads
    # long decode rows get split-KV (packed items + combine) next to unpacked prefill rows
    q_lens = [1, 256, 1, 0, 129, 64]
    seq_lens = [3000, 256 + 37, 1500, 77, 129 + 1, 64 + 640]
    _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=7, pad_rows=3,
         force_split=True)


@pytest.mark.gpu
def test_long_prefill_g7():
    # the benchmark shape (28 q / 4 KV heads, d 128), shortened: 2048 new tokens after a
    # 100-token cached prefix, plus a decode row
    _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS[:2], ids=["g7", "g3"])
def test_fused_writeback_with_unpacked_tiles(heads):
    from cute_kernels.planner import W_QHEAD

    hq, hkv = heads
    g = hq // hkv
    d, dtype = 128, torch.bfloat16
    q_lens = [1, 256, 0, 192, 3, 64]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1]
    case = fused_reference_case(11, 12, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype,
                                page=P, pad_rows=2)
    dp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, unpacked=True, fresh_kv=True)
    assert dp.unpacked and dp.fresh_kv and (dp.host.work[:, W_QHEAD] >= 0).any()
    # the output, and the cache at every position < seq_len against the reference append
    launch_fused_checked(case, dp, "fused + unpacked")
