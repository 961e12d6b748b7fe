"""GPU (sm_90) tests of the lazy-rescaling kernel variants (plans with
``lazy_rescale=True``; the backend's ``ION_LAZY_RESCALE=1``).

Fresh random mixed batches on every kernel form (64-row packed, 64-row unpacked, 128-row
unpacked tiles; split-KV forced and not) against the fp32 reference, ``out`` NaN-poisoned
first. A case whose keys grow in magnitude page by page makes rows move their max past
the threshold mid-sequence, so both the kept-max and the moved-max paths run, and the
lazy output must match the default kernel's as closely as the reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)
from paged_gpu_checks import CHEAP_SPLIT, HEAD_IDS, HEADS, check_out, random_mixed_batch


def _plan(qsl, sl, hkv, g, d, *, tile_m, lazy, unpacked, force_split):
    from cute_kernels.attention import make_device_plan
    from cute_kernels.planner import CostModel

    cm = CostModel(head_dim=d, **CHEAP_SPLIT) if force_split else CostModel(head_dim=d)
    return make_device_plan(qsl.cpu().numpy(), sl.cpu().numpy(), num_kv_heads=hkv,
                            group_size=g, page_size=64, head_dim=d, device="cuda",
                            unpacked_prefill=unpacked, tile_m=tile_m, cost_model=cm,
                            row_combine=True, lazy_rescale=lazy)


def _run(case, hq, hkv, d, *, tile_m, unpacked, force_split, what):
    from cute_kernels.attention import ion_attention

    q, k, v, qsl, sl, bt = case
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k, v, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0])
    outs = {}
    for lazy in (True, False):
        plan = _plan(qsl, sl, hkv, hq // hkv, d, tile_m=tile_m, lazy=lazy,
                     unpacked=unpacked, force_split=force_split)
        assert plan.lazy_rescale is lazy
        out = torch.full_like(q, float("nan"))
        ion_attention(q, k, v, out, qsl, sl, bt, scale, plan=plan)
        torch.cuda.synchronize()
        check_out(out, ref, mask, f"{what}, lazy={lazy}")
        outs[lazy] = out
    # the two kernels round differently (P is scaled by a different max), no more
    assert relative_error(outs[True], outs[False], mask) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["m64", "m64-unpacked", "m128-unpacked"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_lazy_rescale_matches_reference(heads, form):
    hq, hkv = heads
    tile_m = 128 if form.startswith("m128") else 64
    unpacked = form.endswith("unpacked")
    rng = np.random.default_rng(hq * 100 + tile_m + unpacked)
    for trial in range(3):
        q_lens, seq_lens = random_mixed_batch(rng, n_long=1 + trial % 2, page=64)
        case = make_paged_case(int(rng.integers(1 << 30)), q_lens, seq_lens, hq, hkv, 128,
                               device="cuda", pad_rows=(3 if trial == 1 else 0))
        _run(case, hq, hkv, 128, tile_m=tile_m, unpacked=unpacked,
             force_split=(trial == 2), what=f"{form} trial {trial}")


@pytest.mark.gpu
def test_lazy_rescale_with_growing_keys():
    """Keys scaled up page by page (x0.5 .. x4 over the physical pages, which are randomly
    placed): rows' maxima rise past the threshold at unpredictable pages."""
    hq, hkv, d = 28, 4, 128
    q_lens, seq_lens = [1, 1, 700, 64], [5000, 900, 2100, 64]
    q, k, v, qsl, sl, bt = make_paged_case(11, q_lens, seq_lens, hq, hkv, d, device="cuda")
    ramp = torch.linspace(0.5, 4.0, k.shape[0], device="cuda").view(-1, 1, 1, 1)
    k = (k.float() * ramp).to(k.dtype)
    for tile_m, unpacked in ((64, False), (128, True)):
        _run((q, k, v, qsl, sl, bt), hq, hkv, d, tile_m=tile_m, unpacked=unpacked,
             force_split=False, what=f"growing keys, tile_m={tile_m}")
