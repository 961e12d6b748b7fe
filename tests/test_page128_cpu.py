"""128-token pages, the kernel-level experiment (CPU checks).

IonAttentionSm90 has always taken ``page_size`` 64 or 128; the API admitted 64 only. With
``experimental_pages=True`` it now admits 128-token pages: 128-row K/V tiles, one TMA box
per stage, QK^T as m64n128k16 wgmmas, half the per-tile softmax / rescale / barrier work.
The question it answers on the GPU (bench backend ``ion-auto-p128``) is whether wider KV
tiles close the prefill gap to FA3. Here: the refusals, the CTA budget, the plan plumbing,
and that every 128-page variant compiles for sm_90a spill-free with the wide wgmma.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cute_kernels import attention
from cute_kernels.variants import EXPERIMENTAL_PAGE_SIZES, PAGE_SIZE, Variant, variant_for


def test_variant_for_admits_128_token_pages_only_when_asked():
    assert EXPERIMENTAL_PAGE_SIZES == (128,) and PAGE_SIZE == 64
    with pytest.raises(ValueError, match="experimental"):
        variant_for(torch.bfloat16, 128, 7, 128)
    v = variant_for(torch.bfloat16, 128, 7, 128, experimental_pages=True)
    assert v == Variant("bfloat16", 128, 8, 128)
    for bad in (16, 32, 96, 256):
        with pytest.raises(ValueError, match="64 tokens"):
            variant_for(torch.bfloat16, 128, 7, bad, experimental_pages=True)
    assert variant_for(torch.float16, 64, 1, 64).page_size == 64


def test_128_token_pages_run_two_ctas_on_one_kv_stage():
    """One consumer warpgroup on 128-token pages: one K/V stage, two CTAs per SM (the
    two-stage, one-CTA form lost 35% on mixed steps on the H200); two consumer
    warpgroups keep two stages and one CTA."""
    assert attention.ctas_per_sm_for(1) == 2 and attention.kv_stages_for(1) == 2
    assert attention.ctas_per_sm_for(1, 128) == 2 and attention.kv_stages_for(1, 128) == 1
    assert attention.ctas_per_sm_for(2, 128) == 1 and attention.kv_stages_for(2, 128) == 2
    k = attention.make_kernel(Variant("bfloat16", 128, 8, 128), unpacked=True)
    assert k.ctas_per_sm == 2 and k.page == 128 and k.kv_stages == 1
    k2 = attention.make_kernel(Variant("bfloat16", 128, 8, 128), unpacked=True, consumers=2)
    assert k2.ctas_per_sm == 1 and k2.kv_stages == 2
    assert attention.make_kernel(Variant("bfloat16", 128, 8, 64)).ctas_per_sm == 2


#: shared memory an SM gives its resident CTAs (H100/H200: 228 KiB, 1 KiB reserved per CTA)
SM90_SMEM_PER_SM = 228 * 1024


@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("consumers", [1, 2])
@pytest.mark.parametrize("d", [64, 128])
def test_resident_ctas_fit_in_shared_memory(page, consumers, d):
    """K and V stages plus the Q buffers (+ 1 KiB of barriers and reserve per CTA) of every
    resident CTA fit in one SM's shared memory: the grid's ctas_per_sm is real."""
    k = attention.make_kernel(Variant("bfloat16", d, 8, page), consumers=consumers)
    per_cta = 2 * k.kv_stages * page * d * 2 + k.q_bufs * 64 * d * 2 + 2 * 1024
    assert k.ctas_per_sm * per_cta <= SM90_SMEM_PER_SM, (k.ctas_per_sm, per_cta)


def test_device_plan_records_its_page_size_and_grid():
    qsl = np.array([0, 1, 2, 2050], dtype=np.int32)
    sl = np.array([9000, 300, 2048], dtype=np.int32)
    for page, tile_m, ctas in ((64, 64, 264), (128, 64, 264), (128, 128, 132)):
        p = attention.make_device_plan(qsl, sl, num_kv_heads=4, group_size=7, page_size=page,
                                       head_dim=128, device="cpu", tile_m=tile_m,
                                       unpacked_prefill=True)
        assert p.page_size == page and p.num_ctas == ctas
        w = p.host.work[: p.num_items]
        # work items are page ranges: request 0's 9000 tokens are ceil(9000 / page) pages
        req0 = w[w[:, 0] == 0]
        assert req0[:, 5].max() == -(-9000 // page)


@pytest.mark.parametrize("consumers,unpacked", [(1, False), (1, True), (2, True)])
@pytest.mark.parametrize("d", [64, 128])
def test_page128_variants_compile_for_sm90a(consumers, unpacked, d):
    pytest.importorskip("cutlass")
    from cute_kernels.compile_utils import compile_sm90a

    v = Variant("bfloat16", d, 8, 128)
    art = compile_sm90a(attention.make_kernel(v, unpacked, consumers),
                        *attention.fake_args(v, unpacked), compile_options="--enable-tvm-ffi")
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", art.ptx))
    assert "m64n128k16" in shapes, shapes  # QK^T over a 128-row K tile
    assert art.has("cp.async.bulk.tensor") and art.has("mbarrier.try_wait")
    assert art.has("setmaxnreg")
    assert not art.has("st.local"), "register spill to local memory"
