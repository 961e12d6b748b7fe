"""The row-parallel split-KV combine (``CombineRowsSm90``) on the CPU: every variant compiles
for sm_90a without spills, its split loops are unrolled (loads in flight together), its
launch selection follows ``DevicePlan.row_combine``, and the default combine kernel is
untouched (PTX pinned)."""

import hashlib
import re

import pytest

from cute_kernels import attention
from cute_kernels.compile_utils import compile_sm90a
from cute_kernels.variants import ALL_VARIANTS

from combine_launch_checks import launched_combines


def _sha(ptx):
    lines = [ln for ln in ptx.splitlines() if not ln.lstrip().startswith("//")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _vid(v):
    return "-".join(str(x) for x in v)


@pytest.mark.parametrize("variant", ALL_VARIANTS, ids=[_vid(v) for v in ALL_VARIANTS])
def test_row_combine_compiles_for_sm90a(variant):
    art = compile_sm90a(attention.make_combine_kernel(variant, rows=True),
                        *attention.combine_fake_args(variant), compile_options="--enable-tvm-ffi")
    ptx = art.ptx
    assert not art.has("st.local"), "register spill"
    # one 32-column load per lane and split: D/32 of them per split, unrolled x4 -> at least
    # 4 * D/32 partial-O loads at offsets 0, 128, 256, .. bytes from one base
    k = variant.head_dim // 32
    strided = re.findall(r"ld\.global\.b32\s+%r\d+, \[%rd\d+\+(\d+)\];", ptx)
    assert sum(1 for off in strided if int(off) % 128 == 0) >= 4 * (k - 1)
    assert ptx.count("ex2.approx") >= 4, "the weight loop is unrolled (4 exp2 per trip)"
    n_st = len(re.findall(r"st\.global\.b16", ptx))
    assert n_st == k, f"one 16-bit store per lane column, got {n_st}"


def test_default_combine_untouched():
    """The default combine kernel's PTX does not depend on the row-parallel option: built
    twice (once after the row variant, in one process) it is the same, and it differs from
    the row variant."""
    v = ALL_VARIANTS[7]
    a = compile_sm90a(attention.make_combine_kernel(v), *attention.combine_fake_args(v),
                      compile_options="--enable-tvm-ffi").ptx
    r = compile_sm90a(attention.make_combine_kernel(v, rows=True),
                      *attention.combine_fake_args(v), compile_options="--enable-tvm-ffi").ptx
    b = compile_sm90a(attention.make_combine_kernel(v, rows=False),
                      *attention.combine_fake_args(v), compile_options="--enable-tvm-ffi").ptx
    assert _sha(a) == _sha(b) and _sha(a) != _sha(r)


def test_device_plan_carries_the_choice(monkeypatch):
    """``ion_attention`` launches the combine variant named by the plan."""
    from cute_kernels import planner

    launched = launched_combines(monkeypatch, [{"row_combine": False}, {"row_combine": True}])
    assert [rows for rows, _ in launched] == [False, True]
    assert planner.COMBINE_COLS == 6


def test_planner_groups_are_packed_at_the_front():
    """CombineRowsSm90 stops at the first group with ntok == 0: every real group has
    ntok >= 1 and upload zeroes the rows after them."""
    import numpy as np

    qsl = np.array([0, 1, 2, 3, 2051], dtype=np.int32)
    sl = np.array([30000, 20000, 9000, 2048], dtype=np.int32)
    p = planner_plan(qsl, sl)
    assert p.combine.shape[0] > 0 and (p.combine[:, 3] >= 1).all()
    plan = attention.DevicePlan(item_capacity=p.n_items + 50,
                                group_capacity=p.combine.shape[0] + 40,
                                partial_rows_capacity=p.partial_rows, num_ctas=264,
                                head_dim=128, device="cpu", row_combine=True)
    plan.upload(p)
    g = p.combine.shape[0]
    assert (plan.combine[:g, 3] >= 1).all() and not plan.combine[g:].any()


def planner_plan(qsl, sl):
    from cute_kernels.planner import plan

    return plan(qsl, sl, num_kv_heads=4, group_size=7, page_size=64, num_ctas=264,
                max_splits=16, max_partial_rows=256 * 264)
