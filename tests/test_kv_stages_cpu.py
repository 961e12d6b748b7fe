"""CPU tests of the K/V pipeline depth of the 128-row kernels (``IonAttentionSm90(
consumers=2, kv_stages=n)``: the producer may load ``n`` pages ahead; 4 by default over
64-token pages since 2026-12-02, 2 before, 2 with page pairs).

* sm_90a compile from fake tensors, attention and fused writeback, packed and unpacked, at
  every depth: one full and one empty mbarrier per stage (arrival counts 1 and 8), no
  spill, and the CTA's shared memory grows by exactly the K and V stages and fits the
  227 KiB an H200 SM gives one CTA.
* ``kv_stages=None`` and ``kv_stages=4`` compile the default kernel (same PTX; the default
  depth is normalized away so it is compiled once); ``kv_stages=2`` is the old kernel.
* Refusals: on the 64-row kernels, with page pairs, on 128-token pages, other depths;
  ``DevicePlan`` and ``make_device_plan`` carry the option to the launch.
* ``precompile`` builds the deep kernels for the 128-row plans only.
"""
from __future__ import annotations

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402

#: shared memory one CTA may use on sm_90 (227 KiB)
SM90_SMEM_PER_CTA = 232448


def _compile(v, stages, kind):
    unpacked = kind != "plain"
    if kind == "fused":
        k = attention.make_fused_kernel(v, True, consumers=2, kv_stages=stages)
        args = attention.fused_fake_args(v, True)
        obj = k.__self__
    else:
        obj = attention.make_kernel(v, unpacked, consumers=2, kv_stages=stages)
        k, args = obj, attention.fake_args(v, unpacked)
    art = compile_sm90a(k, *args, compile_options="--enable-tvm-ffi", keep_cubin=True)
    return art, obj


@pytest.mark.parametrize("kind", ["plain", "unpacked", "fused"])
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_depth_variant_compiles_for_sm90a(vi, stages, kind):
    from test_two_consumers_cpu import _barrier_init_counts, _check_no_spills

    v = ALL_VARIANTS[vi]
    art, k = _compile(v, stages, kind)
    assert k.kv_stages == stages and k.consumers == 2
    # Q: 2 stages; K and V: `stages` each; full barriers count 1, empty ones 8 (4 per
    # consumer warpgroup)
    n = 2 + 2 * stages
    assert _barrier_init_counts(art.ptx) == [1] * n + [8] * n
    assert art.has("wgmma.mma_async") and art.has("cp.async.bulk.tensor")
    assert ".reqntid 384, 1, 1" in art.ptx and ".minnctapersm 1" in art.ptx
    _check_no_spills(art)
    _, k4 = _compile(v, None, kind)
    assert k4.kv_stages == 4  # the default over 64-token pages
    smem, smem4 = k.shared_storage.size_in_bytes(), k4.shared_storage.size_in_bytes()
    # each stage is one K and one V page tile (P x D); its barriers sit in the head of the
    # struct, which the 1024-byte alignment of sQ pads anyway
    tile = 64 * v.head_dim * 2
    assert smem4 - smem == (4 - stages) * 2 * tile
    assert smem4 <= SM90_SMEM_PER_CTA, f"{smem4} B of shared memory does not fit one SM"


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_default_depth_is_the_default_kernel(kind):
    v = ALL_VARIANTS[7]
    a_none, _ = _compile(v, None, kind)
    a_four, _ = _compile(v, 4, kind)
    a_two, _ = _compile(v, 2, kind)
    assert a_none.ptx == a_four.ptx and a_two.ptx != a_four.ptx
    assert attention.kv_stages_for(2) == 4 and attention.kv_stages_for(1) == 2
    assert attention.check_kv_stages(4, 2) is None
    assert attention.check_kv_stages(2, 2) == 2


def test_pairs_and_128_token_pages_keep_two_stages():
    from cute_kernels.variants import Variant

    assert attention.make_kernel(ALL_VARIANTS[7], consumers=2, kv_pair=True).kv_stages == 2
    assert attention.make_fused_kernel(ALL_VARIANTS[7], True, consumers=2,
                                       kv_pair=True).__self__.kv_stages == 2
    # 4 stages of 128-token K and V would need 256 KiB
    assert attention.kv_stages_for(2, 128) == 2
    assert attention.make_kernel(Variant("bfloat16", 128, 8, 128), unpacked=True,
                                 consumers=2).kv_stages == 2


def test_deep_pipeline_is_refused_where_not_implemented():
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.make_kernel(ALL_VARIANTS[7], kv_stages=2)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.make_fused_kernel(ALL_VARIANTS[7], kv_stages=2)
    with pytest.raises(ValueError, match="kv_pair"):
        attention.make_kernel(ALL_VARIANTS[7], consumers=2, kv_pair=True, kv_stages=2)
    with pytest.raises(ValueError, match="one of"):
        attention.make_kernel(ALL_VARIANTS[7], consumers=2, kv_stages=5)
    with pytest.raises(ValueError, match="one of"):
        attention.make_kernel(ALL_VARIANTS[7], consumers=2, kv_stages=1)
    with pytest.raises(ValueError, match="page_size=128"):
        attention.check_kv_stages(2, 2, page_size=128)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.DevicePlan(item_capacity=1, group_capacity=1, partial_rows_capacity=0,
                             num_ctas=4, head_dim=128, device="cpu", kv_stages=2)
    dp = attention.make_device_plan(np.array([0, 300], np.int32), np.array([300], np.int32),
                                    num_kv_heads=4, group_size=7, page_size=64, head_dim=128,
                                    device="cpu", tile_m=128, unpacked_prefill=True,
                                    kv_stages=2)
    assert dp.kv_stages == 2 and dp.tile_m == 128
    dp4 = attention.make_device_plan(np.array([0, 300], np.int32), np.array([300], np.int32),
                                     num_kv_heads=4, group_size=7, page_size=64, head_dim=128,
                                     device="cpu", tile_m=128, kv_stages=4)
    assert dp4.kv_stages is None


def test_launch_picks_the_deep_kernel(monkeypatch):
    """``ion_attention`` hands the plan's depth to the compiled-kernel cache (both forms)."""
    from test_kv_pair_cpu import default_fused_tail, record_launches

    _, seen = record_launches(monkeypatch, unpacked_prefill=True, kv_stages=2)
    # (kind, unpacked, consumers, lazy, kv_pair, kv_stages, pingpong, pin_pv_wait)
    assert seen == [("attn", True, 2, False, False, 2, None, None),
                    ("fused", True, 2, False, False, 2, None, None) + default_fused_tail()]


def test_precompile_builds_the_asked_depth_for_128_row_plans_only(monkeypatch):
    import torch

    from test_kv_pair_cpu import record_precompile

    calls = record_precompile(monkeypatch)
    attention.precompile(torch.bfloat16, 128, 28, 4, 64, fused=True, unpacked=True,
                         consumers=(1, 2), lane_combine=True, kv_stages=2,
                         vec_straddle=False)  # "auto" doubles the fused: test_kv_pair_cpu
    assert sorted(calls) == sorted(
        (kind, u, c, False, False, 2 if c == 2 else None, None, None)
        for kind in ("attn", "fused") for u in (False, True) for c in (1, 2))
