"""CPU-only sm_90a compile checks (no GPU needed).

* ``test_harness_compiles_tiny_tma_kernel``: the harness in
  ``cute_kernels.compile_utils`` lowers a tiny TMA load/store kernel to PTX for
  sm_90a and the PTX contains the TMA instructions.
* ``test_variant_compiles_for_sm90a``: one case per entry of
  ``cute_kernels.variants.VARIANTS`` (or ``ALL_VARIANTS``); skipped while that
  module does not exist.  A variant is either the ``Variant`` NamedTuple
  (compiled through ``cute_kernels.attention.make_kernel`` / ``fake_args``) and the
  split-KV combine kernel.  The attention PTX must contain ``wgmma.mma_async``,
  ``cp.async.bulk.tensor``, mbarrier waits and ``setmaxnreg``, and no local-memory spills.
"""

from __future__ import annotations

import pytest

cutlass = pytest.importorskip("cutlass")
import cutlass.cute as cute  # noqa: E402
import cutlass.utils as cutlass_utils  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402

from cute_kernels.compile_utils import (  # noqa: E402
    CompiledArtifact,
    compile_sm90a,
    fake_stream,
    fake_tensor,
    sym,
)

# --------------------------------------------------------------------------
# Tiny TMA kernel: one CTA copies a TILE_M x TILE_N fp16 tile
# global -> smem (TMA load, mbarrier completion) -> global (TMA store).
# --------------------------------------------------------------------------
TILE_M, TILE_N = 64, 64


@cute.kernel
def _tma_tile_copy_kernel(
    tma_load: cute.CopyAtom,
    g_src: cute.Tensor,
    tma_store: cute.CopyAtom,
    g_dst: cute.Tensor,
    s_layout: cute.Layout,
):
    bx, by, _ = cute.arch.block_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    smem = cutlass_utils.SmemAllocator()
    mbar = smem.allocate_array(cutlass.Int64, 1, byte_alignment=8)
    s_tile = smem.allocate_tensor(cutlass.Float16, s_layout, byte_alignment=128)
    if warp == 0:
        cpasync.prefetch_descriptor(tma_load)
        cpasync.prefetch_descriptor(tma_store)
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    g_in = cute.local_tile(g_src, (TILE_M, TILE_N), (bx, by))
    g_out = cute.local_tile(g_dst, (TILE_M, TILE_N), (bx, by))
    ld_s, ld_g = cpasync.tma_partition(
        tma_load, 0, cute.make_layout(1),
        cute.group_modes(s_tile, 0, 2), cute.group_modes(g_in, 0, 2),
    )
    st_s, st_g = cpasync.tma_partition(
        tma_store, 0, cute.make_layout(1),
        cute.group_modes(s_tile, 0, 2), cute.group_modes(g_out, 0, 2),
    )
    if warp == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, TILE_M * TILE_N * 2)
        cute.copy(tma_load, ld_g, ld_s, tma_bar_ptr=mbar)
    cute.arch.mbarrier_wait(mbar, 0)
    cute.arch.sync_threads()
    if warp == 0:
        cute.copy(tma_store, st_s, st_g)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def _tma_tile_copy(src: cute.Tensor, dst: cute.Tensor, stream):
    s_layout = cute.make_layout((TILE_M, TILE_N), stride=(TILE_N, 1))
    ld_atom, ld_tensor = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), src, s_layout, (TILE_M, TILE_N)
    )
    st_atom, st_tensor = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileS2GOp(), dst, s_layout, (TILE_M, TILE_N)
    )
    grid = (cute.ceil_div(src.shape[0], TILE_M), cute.ceil_div(src.shape[1], TILE_N), 1)
    _tma_tile_copy_kernel(ld_atom, ld_tensor, st_atom, st_tensor, s_layout).launch(
        grid=grid, block=[128, 1, 1], stream=stream
    )


def test_harness_compiles_tiny_tma_kernel():
    n_cols = sym(32, divisibility=8)  # rows must stay 16-byte aligned for TMA
    src = fake_tensor(cutlass.Float16, (None, n_cols))
    dst = fake_tensor(cutlass.Float16, (None, n_cols))
    art = compile_sm90a(_tma_tile_copy, src, dst, fake_stream())

    assert isinstance(art, CompiledArtifact)
    assert art.arch == "sm_90a"
    assert "\n.target sm_90a" in art.ptx
    assert len(art.kernel_names()) == 1
    ops = art.instructions("cp.async.bulk.tensor")
    # one TMA load (global -> shared, mbarrier completion) and one TMA store
    assert any(".shared::cluster.global" in o or ".shared::cta.global" in o for o in ops), ops
    assert any(".global.shared::cta" in o for o in ops), ops
    assert art.has("mbarrier")
    assert not art.has("wgmma.mma_async")  # no MMA in this kernel


def test_harness_rejects_non_jit_function():
    def plain(x):
        return x

    with pytest.raises(Exception):
        compile_sm90a(plain, fake_tensor(cutlass.Float16, (8, 8)))


def test_fake_tensor_layouts():
    t = fake_tensor(cutlass.BFloat16, (4, 8, 64))
    assert tuple(t.shape) == (4, 8, 64)
    assert tuple(t.stride) == (512, 64, 1)
    import torch

    u = fake_tensor(torch.float16, (None, 8, 128), stride=(None, 128, 1))
    assert u.element_type is cutlass.Float16
    assert tuple(u.stride)[1:] == (128, 1)


# --------------------------------------------------------------------------
# Attention-kernel variants (cute_kernels.variants: VARIANTS, else ALL_VARIANTS)
# --------------------------------------------------------------------------
from cute_kernels import attention  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS, SUPPORTED_GROUP_PADS  # noqa: E402

# Every kernel variant the backend can select: (dtype, head_dim, GQA pad, page).
ATTENTION_EXPECTED_PTX = (
    "wgmma.mma_async",       # QK^T and PV on the tensor cores (warpgroup MMA)
    "cp.async.bulk.tensor",  # Q/K/V tiles by TMA
    "mbarrier.try_wait",     # multi-stage smem pipeline on mbarriers
    "setmaxnreg",            # producer / consumer warpgroup register split
)


def _variant_id(v) -> str:
    return "-".join(str(x) for x in v)


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_variant_id(v) for v in ALL_VARIANTS])
def test_attention_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_kernel(variant), *attention.fake_args(variant),
                        compile_options="--enable-tvm-ffi")
    for needle in ATTENTION_EXPECTED_PTX:
        assert art.has(needle), f"{_variant_id(variant)}: {needle!r} missing from the sm_90a PTX"
    # K and V tiles both arrive by TMA (one 2-D/4-D box each per 64-element chunk of D)
    assert art.count(r"cp\.async\.bulk\.tensor") >= 3
    assert not art.has("st.local"), "register spill to local memory"
    # the trigger for a combine launched with PDL (ION_PDL_COMBINE): once, at the start
    assert art.count(r"griddepcontrol\.launch_dependents;") == 1
    assert art.ptx.find("griddepcontrol.launch_dependents") < art.ptx.find("wgmma.mma_async")


# the combine kernel depends on (dtype, head_dim) only in its data path
@pytest.mark.parametrize("variant", ALL_VARIANTS[:: len(SUPPORTED_GROUP_PADS)], ids=_variant_id)
def test_combine_variant_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_combine_kernel(variant),
                        *attention.combine_fake_args(variant), compile_options="--enable-tvm-ffi")
    assert art.has("ex2.approx"), "the split merge uses exp2 of log2-sum-exp differences"
