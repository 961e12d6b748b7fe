"""The split-KV combine launched by programmatic dependent launch (``CombineSm90(pdl=True)``,
plans with ``pdl_combine=True``, the backend's ``ION_PDL_COMBINE=1``) on the CPU: with PDL the
kernel waits (``griddepcontrol.wait``) before its first global load and its launch allows
programmatic stream serialization; without it neither is there; the plan's choice reaches
the launch."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

from cute_kernels import attention
from cute_kernels.compile_utils import compile_sm90a
from cute_kernels.variants import ALL_VARIANTS, SUPPORTED_GROUP_PADS

from combine_launch_checks import launched_combines

# the combine depends on (dtype, head_dim) only in its data path
_COMBINE_VARIANTS = ALL_VARIANTS[:: len(SUPPORTED_GROUP_PADS)]


def _vid(v):
    return "-".join(str(x) for x in v)


@pytest.mark.parametrize("rows", [False, True, "lanes"], ids=["group", "rows", "lanes"])
@pytest.mark.parametrize("variant", _COMBINE_VARIANTS, ids=[_vid(v) for v in _COMBINE_VARIANTS])
def test_pdl_combine_waits_before_any_load(variant, rows):
    # "lanes": the backend's default combine since the ninth session, so ION_PDL_COMBINE=1
    # launches it
    with_pdl = compile_sm90a(attention.make_combine_kernel(variant, rows=rows, pdl=True),
                             *attention.combine_fake_args(variant),
                             compile_options="--enable-tvm-ffi")
    ptx = with_pdl.ptx
    assert not with_pdl.has("st.local"), "register spill"
    assert ptx.count("griddepcontrol.wait;") == 1
    first_load = re.search(r"\bld\.global", ptx)
    assert first_load and ptx.find("griddepcontrol.wait;") < first_load.start(), \
        "a global load is issued before the wait for the attention grid"
    plain = compile_sm90a(attention.make_combine_kernel(variant, rows=rows),
                          *attention.combine_fake_args(variant),
                          compile_options="--enable-tvm-ffi")
    assert "griddepcontrol" not in plain.ptx
    # apart from the wait, the same kernel
    assert ptx.replace("\tgriddepcontrol.wait;\n", "").count("ld.global") == \
        plain.ptx.count("ld.global")


_IR_PROBE = textwrap.dedent("""
    import cutlass.cute as cute
    from cute_kernels import attention
    from cute_kernels.variants import ALL_VARIANTS
    v = ALL_VARIANTS[7]
    for pdl in (False, True):
        print("== pdl", pdl, flush=True)
        cute.compile(attention.make_combine_kernel(v, rows=True, pdl=pdl),
                     *attention.combine_fake_args(v), options="--enable-tvm-ffi --gpu-arch sm_90a")
        print("== end", flush=True)
""")


def test_pdl_launch_attribute_in_host_ir():
    """The host-side launch of the PDL combine sets programmatic stream serialization (1),
    the default launch does not (0): read off the IR the DSL prints."""
    env = dict(os.environ, CUTE_DSL_PRINT_IR="1", CUTE_DSL_ARCH="sm_90a")
    r = subprocess.run([sys.executable, "-c", _IR_PROBE], capture_output=True, text=True,
                       env=env, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode == 0, r.stderr[-2000:]
    text = r.stdout + r.stderr
    parts = text.split("== pdl ")
    assert len(parts) == 3, text[-2000:]
    flags = {}
    for part in parts[1:]:
        pdl = part.startswith("True")
        found = re.findall(r"programmatic_stream_serialization_allowed\[[^\]]*\] %c(\d)_i32",
                           part)
        assert found, part[-1500:]
        flags[pdl] = set(found)
    assert flags == {False: {"0"}, True: {"1"}}


def test_device_plan_carries_the_choice(monkeypatch):
    """``ion_attention`` launches the combine with PDL exactly when the plan says so."""
    launched = launched_combines(monkeypatch, [{"row_combine": True, "pdl_combine": pdl}
                                               for pdl in (False, True)])
    assert launched == [(True, False), (True, True)]
