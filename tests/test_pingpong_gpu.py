"""GPU (sm_90) tests of warpgroup ping-pong on the 128-row kernels
(``IonAttentionSm90(consumers=2, pingpong=True)``: the two consumer warpgroups take turns
issuing their MMAs through two named barriers).

A ping-pong kernel that deadlocks hangs its launch, and one that reorders a warpgroup's own
MMAs wrongly gives wrong rows, so every test checks, on fresh random inputs (``out``
NaN-poisoned first; rows without work must stay NaN), the ping-pong plan against the fp32
reference and against the same batch through a plan without ping-pong: mixed batches
(decode rows, chunks whose context is not a page multiple, rows with 0 new tokens, padded
rows), G = 7, 8 and 1, D 64/128, bf16/fp16; forced split-KV (many 1-3 page items, so the
turns carry across items); a CTA whose items all have a single page (no steady-state turn);
the anchor prefill shape, shortened.  Fused writeback (``key``/``value``): the output as
above and the cache bit-equal to the reference append at every position < seq_len.
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


def _device_plan(qsl, sl, hkv, g, d, *, pingpong, force_split=False, unpacked=True,
                 fresh_kv=False):
    return device_plan(qsl, sl, hkv=hkv, group_size=g, head_dim=d, page=P,
                       force_split=force_split, unpacked_prefill=unpacked, tile_m=128,
                       lane_combine=True, pingpong=pingpong, fresh_kv=fresh_kv)


def _run(q_lens, seq_lens, *, hq, hkv, d, dtype, seed, pad_rows=0, force_split=False,
         unpacked=True):
    case = reference_case(seed, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, page=P,
                          pad_rows=pad_rows)
    g = hq // hkv
    pp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, pingpong=True,
                      force_split=force_split, unpacked=unpacked)
    assert pp.consumers == 2 and (pp.pingpong is None) == attention_default()
    if force_split:
        assert pp.host.num_splits_max > 1, "split-KV not exercised"
    out_pp = launch_checked(case, pp, "tile_m=128 plan, ping-pong")
    plain = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, pingpong=False,
                         force_split=force_split, unpacked=unpacked)
    out_plain = launch_checked(case, plain, "tile_m=128 plan, no ping-pong")
    check_agree(out_pp, out_plain, case.mask, "ping-pong vs none")
    return pp


def attention_default() -> bool:
    from cute_kernels import attention

    return attention.PINGPONG_DEFAULT


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_pingpong_matches_reference(heads, d, dtype):
    hq, hkv = heads
    rng = np.random.default_rng(13 * hq + d + (dtype == torch.float16))
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=P,
                                              long_ctx=(0, 1, 37, 64, 100, 1000))
        _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype, seed=300 + trial,
             pad_rows=(5 if trial == 1 else 0), unpacked=trial != 2)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_pingpong_split_kv(heads):
    hq, hkv = heads
    # many short items under a split-friendly cost model: items of 1-3 pages, so a
    # warpgroup's turns (one per page) carry across many items
    q_lens = [1, 1, 1, 256, 0, 129, 1, 200]
    seq_lens = [150, 300, 560, 256 + 37, 77, 129 + 1, 3000, 200 + 2500]
    p = _run(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, dtype=torch.bfloat16, seed=23,
             pad_rows=3, force_split=True)
    w = p.host.work
    assert (w[:, 7] > 1).any() and ((w[:, 5] - w[:, 4]) < 4).any()


@pytest.mark.gpu
def test_pingpong_single_page_items():
    # every item one page: only the first-page turn, no steady-state loop
    p = _run([1] * 40 + [64], [50] * 40 + [64], hq=28, hkv=4, d=128, dtype=torch.bfloat16,
             seed=29)
    w = p.host.work
    assert ((w[:, 5] - w[:, 4]) == 1).all()


@pytest.mark.gpu
def test_pingpong_long_prefill_g7():
    # the anchor shape (28 q / 4 KV heads, d 128), shortened; a decode row beside
    p = _run([2048, 1], [2148, 500], hq=28, hkv=4, d=128, dtype=torch.bfloat16, seed=31)
    assert (p.host.work[:, 8] >= 0).any(), "no unpacked prefill item"


@pytest.mark.gpu
@pytest.mark.parametrize("force_split", [False, True], ids=["plain", "split"])
@pytest.mark.parametrize("unpacked", [False, True], ids=["packed", "unpacked"])
def test_pingpong_fused_writeback(unpacked, force_split):
    hq, hkv, d, dtype = 28, 4, 128, torch.bfloat16
    g = hq // hkv
    # contexts 37, 0, 1 and 70 (fresh tiles straddle pages), decode rows, a row with 0 new
    # tokens, chunks of 1-3 fresh tiles
    q_lens = [1, 256, 0, 192, 3, 64, 130, 1]
    seq_lens = [700, 256 + 37, 50, 192, 90, 64 + 1, 130 + 70, 150]
    s = 51 + unpacked + 2 * force_split
    case = fused_reference_case(s, s + 1, q_lens, seq_lens, hq=hq, hkv=hkv, d=d, dtype=dtype,
                                page=P, pad_rows=2)
    dp = _device_plan(case.qsl_h, case.sl_h, hkv, g, d, pingpong=True,
                      unpacked=unpacked, fresh_kv=True, force_split=force_split)
    assert dp.fresh_kv and dp.consumers == 2
    if force_split:
        assert (dp.host.work[:, 7] > 1).any(), "split-KV not exercised"
    launch_fused_checked(case, dp, "fused, ping-pong")
