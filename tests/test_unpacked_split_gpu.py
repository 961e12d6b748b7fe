"""GPU (sm_90) tests of split unpacked prefill tiles (v18): an unpacked item (one q head x
64/128/192 tokens) whose KV range is split writes its fp32 partials in the chunked packed
layout of ``planner.partial_row`` and the unchanged combine pass merges them.

Fresh random inputs; the output is NaN-poisoned and so is the split-KV workspace (a
partial read before it is written shows up as NaN); fp32 reference.  Every tile size
(1, 2 and 3 consumer warpgroups), plain and fused writeback (cache bit-equal to the
reference append), G = 7 (8-token chunks) and G = 3 (16-token chunks), token counts that
end inside a chunk; every combine kernel; a cost model that makes splitting free, and the
default one on the chunk that motivated it (2048 new tokens over 6144 cached, 28/4 heads).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_gpu_checks import (
    CHEAP_SPLIT,
    device_plan,
    fused_reference_case,
    launch_checked,
    launch_fused_checked,
    reference_case,
)

P = 64
#: long chunks over cached context (unpacked, split), token counts ending inside a chunk,
#: decode rows beside them (packed, split), a row with no new token
Q_LENS = [1, 333, 0, 700, 1, 190, 129]
SEQ_LENS = [2900, 333 + 2200, 40, 700 + 1000, 3000, 190 + 2600, 129 + 37]


def _split_plan(case, hkv, g, tile_m, **options):
    """``make_device_plan`` under a cost model where splitting is free (``CHEAP_SPLIT``
    plus free partial traffic and no gain threshold), so that unpacked tiles split at
    every tile size; the default model splits them only where it pays (last test)."""
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=128, partial_bytes=0, split_min_gain=0.0, **CHEAP_SPLIT)
    return make_device_plan(case.qsl_h, case.sl_h, num_kv_heads=hkv, group_size=g,
                            page_size=P, head_dim=128, device="cuda", cost_model=cm,
                            unpacked_prefill=True, tile_m=tile_m, **options)


def _unpacked_split(dp) -> np.ndarray:
    w = dp.host.work
    return (w[:, 8] >= 0) & (w[:, 7] > 1)


def _poison_workspace(dp) -> None:
    dp.partial_o.fill_(float("nan"))
    dp.partial_lse.fill_(float("nan"))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("heads", [(28, 4), (12, 4)], ids=["g7", "g3"])
def test_split_unpacked_tiles_match_reference(heads, tile_m, fused):
    hq, hkv = heads
    g = hq // hkv
    seed = 900 + tile_m + 7 * g + fused
    if fused:
        case = fused_reference_case(seed, seed + 1, Q_LENS, SEQ_LENS, hq=hq, hkv=hkv, d=128,
                                    dtype=torch.bfloat16, page=P, pad_rows=3)
    else:
        case = reference_case(seed, Q_LENS, SEQ_LENS, hq=hq, hkv=hkv, d=128,
                              dtype=torch.bfloat16, page=P, pad_rows=3)
    dp = _split_plan(case, hkv, g, tile_m, lane_combine=True, fresh_kv=fused)
    sel = _unpacked_split(dp)
    assert sel.any(), "no split unpacked item"
    c = 64 // (4 if g == 3 else 8)
    assert (dp.host.work[sel, 3] % c != 0).any(), "no chunk ends early"
    _poison_workspace(dp)
    what = f"split unpacked, tile_m={tile_m}, G={g}"
    if fused:
        launch_fused_checked(case, dp, what)
    else:
        launch_checked(case, dp, what)


@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["lanes", "rows", "groups"])
def test_split_unpacked_tiles_under_every_combine_kernel(combine):
    case = reference_case(931, Q_LENS, SEQ_LENS, hq=28, hkv=4, d=128, dtype=torch.bfloat16,
                          page=P)
    dp = _split_plan(case, 4, 7, 128, lane_combine=combine == "lanes",
                     row_combine=combine == "rows")
    assert _unpacked_split(dp).any()
    _poison_workspace(dp)
    launch_checked(case, dp, f"split unpacked, {combine} combine")


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [128, 192])
def test_chunk_2048_over_6144_default_plan(tile_m):
    """The shape the split was made for, fused as the backend runs it, default cost model:
    the planner splits some unpacked tiles, and the result is the reference's."""
    case = fused_reference_case(940 + tile_m, 941 + tile_m, [2048], [8192], hq=28, hkv=4,
                                d=128, dtype=torch.bfloat16, page=P)
    dp = device_plan(case.qsl_h, case.sl_h, hkv=4, group_size=7, head_dim=128, page=P,
                     unpacked_prefill=True, tile_m=tile_m, lane_combine=True, fresh_kv=True)
    assert _unpacked_split(dp).any()
    _poison_workspace(dp)
    launch_fused_checked(case, dp, f"chunk 2048 over 6144, tile_m={tile_m}")
