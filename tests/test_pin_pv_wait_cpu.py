"""CPU tests of the pinned PV wait (``IonAttentionSm90(pin_pv_wait=True)``): the steady
state's ``wgmma.wait_group 0`` (the previous O += P V) sits in both arms of a branch on the
softmax's row sum, so ptxas keeps it after the softmax.

* In the SASS (nvdisasm from the CUDA wheels; skipped without it) of the default kernels,
  ptxas has moved that wait up: between the steady state's two waits
  (``WARPGROUP.DEPBAR``) after its QK^T + PV issue there is no ``MUFU.EX2``.  With the
  option every exp2 of the page's softmax (32 a thread on 64-key tiles, 64 on page pairs)
  comes before the second wait, for the 64-row and 128-row kernels, plain, unpacked and
  fused, D 64 and 128, bf16 and fp16, with page pairs and with ping-pong; no spills.
* The PTX of the default kernels is unchanged (``pin_pv_wait=None`` and the default value
  compile the same PTX; the pins in the other CPU tests still hold).
* ``DevicePlan`` / ``make_device_plan`` / ``ion_attention`` / ``precompile`` carry the
  option to the compiled-kernel cache; the bench backends ``ion-auto-pin`` /
  ``ion-auto-fused-pin`` plan it; the sweep passes ``--pin-pv-wait``.
"""
from __future__ import annotations

import re

import pytest

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402

_TAGS = ("HGMMA", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "MUFU.EX2")


def _compile(v, kind, consumers, pin, **extra):
    unpacked = kind != "plain"
    if kind == "fused":
        k = attention.make_fused_kernel(v, True, consumers=consumers, pin_pv_wait=pin, **extra)
        args = attention.fused_fake_args(v, True)
        obj = k.__self__
    else:
        obj = attention.make_kernel(v, unpacked, consumers=consumers, pin_pv_wait=pin,
                                    **extra)
        k, args = obj, attention.fake_args(v, unpacked)
    return compile_sm90a(k, *args, compile_options="--enable-tvm-ffi", keep_cubin=True), obj


def _waits0(ptx) -> int:
    """``wgmma.wait_group 0`` instructions in the PTX."""
    return len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx))


def _sass_or_skip(art):
    from test_fused_writeback_cpu import _sass

    sass = _sass(art.cubin)
    if sass is None:
        pytest.skip("nvdisasm not installed")
    return sass


def _tagged(sass):
    seq = []
    for line in sass.splitlines():
        if not re.search(r"/\*[0-9a-f]{4,6}\*/", line):
            continue
        for tag in _TAGS:
            if tag in line:
                seq.append(tag)
                break
    return seq


def exps_before_pv_wait(sass) -> int:
    """MUFU.EX2 between the two wgmma waits that follow the steady state's issue: two wgmma
    groups (``WARPGROUP.ARRIVE`` + HGMMAs: S_p = Q K^T, then O += P V) with no wait in
    between."""
    seq = _tagged(sass)
    n = len(seq)

    def group_end(i):  # i at an ARRIVE followed by HGMMAs: index after the HGMMA run
        j = i + 1
        if j >= n or seq[j] != "HGMMA":
            return None
        while j < n and seq[j] == "HGMMA":
            j += 1
        return j

    for i in range(n):
        if seq[i] != "WARPGROUP.ARRIVE":
            continue
        j = group_end(i)
        if j is None or j >= n or seq[j] != "WARPGROUP.ARRIVE":
            continue
        k = group_end(j)
        if k is None:
            continue
        waits = [m for m in range(k, n) if seq[m] == "WARPGROUP.DEPBAR"][:2]
        assert len(waits) == 2, "no two waits after the steady-state issue"
        return seq[waits[0]:waits[1]].count("MUFU.EX2")
    raise AssertionError("no steady-state QK^T + PV issue found in the SASS")


CASES = [
    # (variant index, kind, consumers, extra options, exp2s of one page a thread)
    (7, "unpacked", 2, {}, 32),
    (7, "fused", 2, {}, 32),
    (7, "plain", 1, {}, 32),
    (7, "fused", 1, {}, 32),
    (1, "unpacked", 2, {}, 32),
    (12, "plain", 2, {}, 32),
    (7, "unpacked", 2, {"kv_pair": True}, 64),
    (7, "unpacked", 2, {"pingpong": True}, 32),
]


@pytest.mark.parametrize("vi,kind,consumers,extra,per_page", CASES,
                         ids=[f"v{c[0]}-{c[1]}-c{c[2]}" + "".join(f"-{k}" for k in c[3])
                              for c in CASES])
def test_pv_wait_stays_after_the_softmax(vi, kind, consumers, extra, per_page):
    from test_two_consumers_cpu import _check_no_spills

    v = ALL_VARIANTS[vi]
    art, k = _compile(v, kind, consumers, True, **extra)
    assert k.pin_pv_wait
    sass = _sass_or_skip(art)
    _check_no_spills(art)
    assert exps_before_pv_wait(sass) >= per_page
    plain, k0 = _compile(v, kind, consumers, False, **extra)
    assert not k0.pin_pv_wait
    # what the option works around: ptxas hoists the wait above the softmax
    assert exps_before_pv_wait(_sass_or_skip(plain)) == 0
    assert art.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    # both arms of the branch wait
    assert _waits0(art.ptx) == _waits0(plain.ptx) + 1


def test_default_is_one_kernel():
    v = ALL_VARIANTS[7]
    a_none, k_none = _compile(v, "unpacked", 2, None)
    a_def, _ = _compile(v, "unpacked", 2, attention.PIN_PV_WAIT_DEFAULT)
    assert k_none.pin_pv_wait == attention.PIN_PV_WAIT_DEFAULT
    assert a_none.ptx == a_def.ptx
    assert attention.check_pin_pv_wait(None) is None
    assert attention.check_pin_pv_wait(attention.PIN_PV_WAIT_DEFAULT) is None
    on = not attention.PIN_PV_WAIT_DEFAULT
    assert attention.check_pin_pv_wait(on) is on


def test_launch_and_precompile_carry_the_option(monkeypatch):
    import torch

    from test_kv_pair_cpu import default_fused_tail, record_launches, record_precompile

    on = not attention.PIN_PV_WAIT_DEFAULT
    plans, seen = record_launches(monkeypatch, tile_ms=(64, 128), pin_pv_wait=on)
    assert all(dp.pin_pv_wait is on for dp in plans)
    # (kind, unpacked, consumers, lazy, kv_pair, kv_stages, pingpong, pin_pv_wait)
    tail = default_fused_tail()
    assert seen == [("attn", False, 1, False, False, None, None, on),
                    ("fused", False, 1, False, False, None, None, on) + tail,
                    ("attn", False, 2, False, False, None, None, on),
                    ("fused", False, 2, False, False, None, None, on) + tail]
    monkeypatch.undo()
    calls = record_precompile(monkeypatch)
    attention.precompile(torch.bfloat16, 128, 28, 4, 64, fused=True, unpacked=True,
                         consumers=(1, 2), lane_combine=True, pin_pv_wait=on,
                         vec_straddle=False)  # "auto" doubles the fused: test_kv_pair_cpu
    assert sorted(calls) == sorted(
        (kind, u, c, False, False, None, None, on)
        for kind in ("attn", "fused") for u in (False, True) for c in (1, 2))


def test_bench_backends_and_sweep_pass_the_option(monkeypatch):
    import torch
    from script_loader import load_script
    from test_kv_pair_cpu import record_bench_plans

    from ion_vllm.bench import kernel_runner as kr

    seen, prefill, mixed, auto = record_bench_plans(monkeypatch)
    for name, fresh in (("ion-auto-pin", False), ("ion-auto-fused-pin", True)):
        assert name in kr.BACKENDS
        seen.clear()
        kr.PREPARE[name](prefill, 0, "cpu", {})
        kr.PREPARE[name](mixed, 0, "cpu", {})
        extra = {"fresh_kv": True} if fresh else {}
        assert seen == [dict(auto, tile_m=128, pin_pv_wait=True, **extra),
                        dict(auto, tile_m=64, pin_pv_wait=True, **extra)]
    sweep = load_script("gpu_sweep.py", "gpu_sweep_pin")
    assert sweep.parse_args(["--pin-pv-wait", "on"]).pin_pv_wait == "on"
    assert sweep.parse_args([]).pin_pv_wait is None
    got = {}
    monkeypatch.setattr(attention, "make_device_plan", lambda *a, **k: got.update(k))
    sweep.make_plan(sweep.make_cases(1, 0)[0], torch.tensor([0, 1]), torch.tensor([5]), "cpu",
                    force_split=False, fresh_kv=False, pin_pv_wait=True)
    assert got["pin_pv_wait"] is True
