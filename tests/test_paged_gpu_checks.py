"""CPU tests of the shared GPU-test helpers in ``paged_gpu_checks`` (reference case, plans,
checked launch, agreement): the GPU tests rely on them to fail on a wrong kernel, so here
they run with stand-in attention functions on the CPU, correct and broken."""
from __future__ import annotations

import pytest
import torch

from cute_kernels.reference import reference_paged_attention
from paged_gpu_checks import (
    check_agree,
    device_plan,
    fused_reference_case,
    launch_checked,
    launch_fused_checked,
    reference_case,
)

Q_LENS, SEQ_LENS = [1, 70, 0, 3], [300, 70 + 37, 20, 90]


def _case():
    return reference_case(3, Q_LENS, SEQ_LENS, hq=8, hkv=2, d=64, dtype=torch.float32,
                          page=64, pad_rows=2, device="cpu")


def _exact(q, k, v, out, qsl, sl, bt, scale, plan=None):
    # rows without work (padding, the 0-token request) are left as they were
    ref = reference_paged_attention(q, k, v, qsl, sl, bt, scale)
    n = int(qsl[-1])
    out[:n] = ref[:n].to(out.dtype)


def test_a_correct_launch_passes_and_returns_its_output():
    case = _case()
    assert case.mask.sum() == sum(Q_LENS) and case.mask.numel() == sum(Q_LENS) + 2
    out = launch_checked(case, None, "exact", attention=_exact)
    assert torch.equal(out[case.mask], case.ref[case.mask].to(out.dtype))
    assert torch.isnan(out[~case.mask]).all()
    check_agree(out, out.clone(), case.mask, "same")


def test_broken_launches_fail():
    case = _case()

    def noisy(q, k, v, out, *a, **kw):
        _exact(q, k, v, out, *a, **kw)
        out[0] += 0.5

    def pads_too(q, k, v, out, *a, **kw):
        _exact(q, k, v, out, *a, **kw)
        out[-1] = 0.0

    def skips_a_row(q, k, v, out, *a, **kw):
        _exact(q, k, v, out, *a, **kw)
        out[1] = float("nan")

    with pytest.raises(AssertionError, match="rel err"):
        launch_checked(case, None, "noisy", attention=noisy)
    with pytest.raises(AssertionError, match="row without work"):
        launch_checked(case, None, "pads", attention=pads_too)
    with pytest.raises(AssertionError, match="NaN in a written row"):
        launch_checked(case, None, "skips", attention=skips_a_row)
    good = launch_checked(case, None, "exact", attention=_exact)
    bad = good.clone()
    bad[0] += 0.5
    with pytest.raises(AssertionError, match="rel diff"):
        check_agree(good, bad, case.mask, "differ")


def test_device_plan_forces_splits_only_when_asked():
    # 40 decode rows of 3,000 tokens: the default cost model splits each in 3, the
    # split-friendly one in 8
    qsl = list(range(41))
    sl = [3000] * 40
    kw = dict(hkv=4, group_size=7, head_dim=128, device="cpu", unpacked_prefill=True)
    plain = device_plan(qsl, sl, **kw)
    forced = device_plan(qsl, sl, force_split=True, **kw)
    assert forced.host.num_splits_max > plain.host.num_splits_max
    assert forced.unpacked and plain.unpacked


# --------------------------------------------------------------------------- fused writeback
def _fused_case():
    return fused_reference_case(21, 22, Q_LENS, SEQ_LENS, hq=8, hkv=2, d=64,
                                dtype=torch.float32, page=64, pad_rows=2, device="cpu")


def test_fused_case_is_the_inline_construction_the_tests_had():
    """Same draws as the fused-writeback GPU tests built inline before the helper existed
    (make_paged_case(seed), key / value from a CPU generator seeded key_seed, reference
    append into cache copies, reference attention over those)."""
    from cute_kernels.reference import (default_softmax_scale, make_paged_case,
                                        new_token_slot_mapping, reference_kv_append)

    case = _fused_case()
    q, k_cache, v_cache, qsl, sl, bt = make_paged_case(21, Q_LENS, SEQ_LENS, 8, 2, 64, page=64,
                                                       dtype=torch.float32, device="cpu",
                                                       pad_rows=2)
    gen = torch.Generator().manual_seed(22)
    key = torch.randn(q.shape[0], 2, 64, generator=gen)
    value = torch.randn(q.shape[0], 2, 64, generator=gen)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference_kv_append(key, value, ref_k, ref_v,
                        new_token_slot_mapping(qsl, sl, bt, 64, total_q=q.shape[0]))
    ref = reference_paged_attention(q, ref_k, ref_v, qsl, sl, bt, default_softmax_scale(64))
    for got, want in ((case.q, q), (case.k_cache, k_cache), (case.key, key),
                      (case.value, value), (case.ref_k, ref_k), (case.ref_v, ref_v),
                      (case.ref, ref), (case.block_table, bt)):
        assert torch.equal(got, want)
    assert not torch.equal(case.ref_k, case.k_cache), "the append must change the cache"
    assert case.sl_h.tolist() == SEQ_LENS and case.page == 64


def _fused_exact(q, k, v, out, qsl, sl, bt, scale, plan=None, key=None, value=None):
    from cute_kernels.reference import new_token_slot_mapping, reference_kv_append

    reference_kv_append(key, value, k, v, new_token_slot_mapping(qsl, sl, bt, 64,
                                                                  total_q=q.shape[0]))
    _exact(q, k, v, out, qsl, sl, bt, scale)


def test_fused_launch_checks_output_and_cache():
    out = launch_fused_checked(_fused_case(), None, "exact", attention=_fused_exact)
    case = _fused_case()
    assert torch.isnan(out[~case.mask]).all()

    def drops_a_v_row(q, k, v, out, *a, **kw):
        _fused_exact(q, k, v, out, *a, **kw)
        bt, pos = a[2], SEQ_LENS[1] - 1  # the last new token of request 1
        v[int(bt[1, pos // 64]), :, pos % 64] += 1.0

    def forgets_the_new_tokens(q, k, v, out, qsl, sl, bt, scale, plan=None, key=None,
                               value=None):
        _exact(q, k, v, out, qsl, sl, bt, scale)

    with pytest.raises(AssertionError, match=r"\(1, 106\)"):
        launch_fused_checked(_fused_case(), None, "drops", attention=drops_a_v_row)
    with pytest.raises(AssertionError):
        launch_fused_checked(_fused_case(), None, "forgets", attention=forgets_the_new_tokens)
