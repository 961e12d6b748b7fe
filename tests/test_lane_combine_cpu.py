"""The split-parallel split-KV combine (``CombineLanesSm90``, plans with ``lane_combine=True``,
the backend's ``ION_LANE_COMBINE=1``) on the CPU: every (dtype, head_dim) variant compiles
for sm_90a without spills; one row's lse and the partial O of its first 8 splits are all
loaded before the first shuffle of the max reduction, i.e. in flight together; the weights
travel by shuffle; the plan's choice reaches the launch and takes precedence over the row
combine."""

import re

import pytest

from cute_kernels import attention
from cute_kernels.combine_sm90 import CombineLanesSm90
from cute_kernels.compile_utils import compile_sm90a
from cute_kernels.variants import ALL_VARIANTS, SUPPORTED_GROUP_PADS

from combine_launch_checks import launched_combines

_COMBINE_VARIANTS = ALL_VARIANTS[:: len(SUPPORTED_GROUP_PADS)]


def _vid(v):
    return "-".join(str(x) for x in v)


@pytest.mark.parametrize("variant", _COMBINE_VARIANTS, ids=[_vid(v) for v in _COMBINE_VARIANTS])
def test_lane_combine_compiles_with_its_loads_in_flight(variant):
    art = compile_sm90a(attention.make_combine_kernel(variant, rows="lanes"),
                        *attention.combine_fake_args(variant), compile_options="--enable-tvm-ffi")
    ptx = art.ptx
    assert not art.has("st.local"), "register spill"
    lines = ptx.splitlines()
    first_reduce = next(i for i, ln in enumerate(lines) if "shfl.sync.bfly" in ln)
    # partial-O loads: D/32 per split at lane + 32 * j (offsets 0, 128, .. bytes)
    k = variant.head_dim // 32
    o_loads = [i for i, ln in enumerate(lines)
               if re.search(r"ld\.global\.b32\s+%r\d+, \[%rd\d+(\+\d+)?\];", ln)]
    before = sum(1 for i in o_loads if i < first_reduce)
    S = CombineLanesSm90.SPLITS_IN_FLIGHT
    assert before >= 1 + S * k, f"only {before} loads before the max reduction"
    assert ptx.count("shfl.sync.idx") >= S, "weights are broadcast from their lanes"
    assert len(re.findall(r"st\.global\.b16", ptx)) == k


def test_kind_is_checked_and_distinct():
    v = ALL_VARIANTS[7]
    with pytest.raises(ValueError, match="combine kind"):
        attention.make_combine_kernel(v, rows="columns")
    assert type(attention.make_combine_kernel(v, rows="lanes")).__name__ == "CombineLanesSm90"
    assert type(attention.make_combine_kernel(v, rows=True)).__name__ == "CombineRowsSm90"
    assert type(attention.make_combine_kernel(v)).__name__ == "CombineSm90"


def test_device_plan_carries_the_choice(monkeypatch):
    launched = launched_combines(
        monkeypatch, [{"row_combine": rows, "lane_combine": lanes}
                      for rows, lanes in ((False, False), (True, False), (True, True),
                                          (False, True))])
    assert [rows for rows, _ in launched] == [False, True, "lanes", "lanes"]
