"""Lazy rescaling (``IonAttentionSm90(lazy_rescale=True)``, plans with
``lazy_rescale=True``), checked on the CPU.

1. The algorithm: an fp32 emulation of the kernel's per-row online softmax over 64-key
   pages, with the kernel's threshold and -inf handling, against the project's reference
   attention, on cases where a row's max rises past the threshold mid-sequence (the
   update path) and stays below it elsewhere (the skipped rescales).
2. The variants compile for sm_90a with wgmma and TMA, without spills, and differ from the
   default kernels only by the lazy branch (the default PTX is pinned in
   tests/test_two_consumers_cpu.py)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from cute_kernels.reference import (
    default_softmax_scale,
    make_paged_case,
    reference_paged_attention,
    relative_error,
)


def _lazy_attention(q, k_cache, v_cache, qsl, seq_lens, bt, scale, threshold, page):
    """The kernel's lazy online softmax, row by row in fp32: returns the output and how
    many (row, page) steps moved the max after the first page / kept it."""
    from cute_kernels.attention_sm90 import LAZY_RESCALE_LOG2

    assert threshold == LAZY_RESCALE_LOG2
    s_log2 = scale * math.log2(math.e)
    hq, hkv = q.shape[1], k_cache.shape[1]
    g = hq // hkv
    out = torch.zeros_like(q, dtype=torch.float32)
    moved = kept = 0
    for b in range(len(seq_lens)):
        L = int(seq_lens[b])
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        n_pages = -(-L // page)
        K = torch.cat([k_cache[int(bt[b, p])] for p in range(n_pages)], dim=1).float()
        V = torch.cat([v_cache[int(bt[b, p])] for p in range(n_pages)], dim=1).float()
        for i in range(q0, q1):
            pos = L - (q1 - q0) + (i - q0)
            for h in range(hq):
                kh = h // g
                m = -math.inf
                l = 0.0
                o = torch.zeros(q.shape[2])
                for p in range(n_pages):
                    keys = torch.arange(p * page, (p + 1) * page)
                    s = K[kh, p * page:(p + 1) * page] @ q[i, h].float()
                    s = torch.where(keys <= min(pos, L - 1), s, torch.tensor(-math.inf))
                    mx = max(m, float(s.max()))
                    corr = 1.0
                    if (mx - m) * s_log2 > threshold:  # -inf - -inf is NaN: False
                        corr = 2.0 ** ((m - mx) * s_log2)
                        moved += p > 0
                        m = mx
                    else:
                        kept += 1
                    m_use = 0.0 if m == -math.inf else m
                    pr = torch.exp2(s * s_log2 - m_use * s_log2)
                    assert float(pr.max()) <= 2.0 ** threshold * (1 + 1e-6)
                    l = l * corr + float(pr.sum())
                    o = o * corr + pr @ V[kh, p * page:(p + 1) * page]
                out[i, h] = o / l
    return out, moved, kept


def test_lazy_online_softmax_is_exact():
    torch.manual_seed(0)
    hq, hkv, d, page = 4, 2, 64, 64
    q_lens, seq_lens = [1, 5, 70], [700, 300, 400]
    q, k, v, qsl, sl, bt = make_paged_case(5, q_lens, seq_lens, hq, hkv, d, page=page,
                                           dtype=torch.float32)
    # physical pages of growing magnitude (pages are randomly placed): some rows' max rises
    # past the threshold mid-sequence, others stay below it
    ramp = torch.linspace(0.5, 3.0, k.shape[0]).view(-1, 1, 1, 1)
    k = k * ramp
    scale = default_softmax_scale(d)
    ref = reference_paged_attention(q, k, v, qsl, sl, bt, scale)
    out, moved, kept = _lazy_attention(q, k, v, qsl, sl, bt, scale, 8.0, page)
    assert moved > 0 and kept > 0, (moved, kept)  # both branches ran
    assert relative_error(out, ref) < 1e-5


# ----------------------------------------------------------------------- sm_90a compile

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402

# (variant index, kind, consumers): the prefill anchor's shape (bf16, d 128, G 7 -> 8) on
# every kernel form the backend plans (packed 64-row, unpacked 128-row, fused), plus d 64
_LAZY = [(7, "plain", 1), (7, "unpacked", 2), (7, "fused", 1), (1, "plain", 1)]
_THRESHOLD = "0f41000000"  # 8.0f: LAZY_RESCALE_LOG2 as a PTX immediate


def _compile(vi, kind, consumers, lazy):
    v = ALL_VARIANTS[vi]
    if kind == "fused":
        return compile_sm90a(
            attention.make_fused_kernel(v, False, consumers, lazy_rescale=lazy),
            *attention.fused_fake_args(v), compile_options="--enable-tvm-ffi",
            keep_cubin=lazy)
    u = kind == "unpacked"
    return compile_sm90a(attention.make_kernel(v, u, consumers, lazy_rescale=lazy),
                         *attention.fake_args(v, u), compile_options="--enable-tvm-ffi",
                         keep_cubin=lazy)


@pytest.mark.parametrize("vi,kind,consumers", _LAZY,
                         ids=[f"{a}-{b}-c{c}" for a, b, c in _LAZY])
def test_lazy_variant_compiles_for_sm90a(vi, kind, consumers):
    from test_two_consumers_cpu import _check_no_spills

    lazy = _compile(vi, kind, consumers, True)
    assert lazy.has("wgmma.mma_async") and lazy.has("cp.async.bulk.tensor")
    _check_no_spills(lazy)
    # the threshold test, per row slot and softmax site
    assert re.search(r"setp\.gt\.f32\s+%p\d+, %r\d+, " + _THRESHOLD, lazy.ptx)
    # the O rescale is skipped by a branch taken when both rows' corrections are 1.0
    skip = re.search(r"setp\.eq\.f32\s+(%p\d+), %r\d+, 0f3F800000;\s*"
                     r"setp\.eq\.f32\s+(%p\d+), %r\d+, 0f3F800000;\s*"
                     r"and\.pred\s+(%p\d+), (%p\d+), (%p\d+);", lazy.ptx)
    assert skip and {skip.group(4), skip.group(5)} == {skip.group(1), skip.group(2)}
    assert re.search(r"@" + re.escape(skip.group(3)) + r"\s+bra", lazy.ptx)
    if vi == 7 and kind == "plain":  # the default of the same form has no lazy branch
        default = _compile(vi, kind, consumers, False)
        assert _THRESHOLD not in default.ptx


def test_plans_carry_the_choice():
    from cute_kernels.attention import DevicePlan

    dp = DevicePlan(item_capacity=4, group_capacity=1, partial_rows_capacity=0, num_ctas=2,
                    head_dim=128, device="cpu", lazy_rescale=True)
    assert dp.lazy_rescale is True
    assert DevicePlan(item_capacity=4, group_capacity=1, partial_rows_capacity=0, num_ctas=2,
                      head_dim=128, device="cpu").lazy_rescale is False
