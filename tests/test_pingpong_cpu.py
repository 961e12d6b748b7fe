"""CPU tests of warpgroup ping-pong on the 128-row kernels (``IonAttentionSm90(consumers=2,
pingpong=True)``: the two consumer warpgroups take turns issuing their MMAs through two
named barriers, ids ``PINGPONG_BARRIER`` and ``+1``).

* sm_90a compile from fake tensors, attention and fused writeback, packed and unpacked,
  D 64/128, bf16/fp16, 4 and 2 K/V stages: no spill, the same wgmma count as without
  ping-pong, one initial arrive on barrier 1, and in the consumer's instruction stream
  every turn (``bar.sync`` on a named barrier) holds a QK^T or a QK^T + PV issue, is
  passed on (``bar.arrive``) right after its ``wgmma.commit_group`` and before any
  ``wgmma.wait_group``; the item's last PV is issued outside any turn.
* Without ping-pong the kernel has no named barrier at all (its code is unchanged);
  ``pingpong=None`` and ``pingpong=PINGPONG_DEFAULT`` compile the same PTX.
* Refusals (64-row kernels), ``DevicePlan`` / ``make_device_plan`` / ``ion_attention`` /
  ``precompile`` carry the option to the compiled-kernel cache; the bench backends
  ``ion-auto-pp`` / ``-np`` plan it on 128-row tiles only.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

cutlass = pytest.importorskip("cutlass")

from cute_kernels import attention  # noqa: E402
from cute_kernels.attention_sm90 import PINGPONG_BARRIER, IonAttentionSm90  # noqa: E402
from cute_kernels.compile_utils import compile_sm90a  # noqa: E402
from cute_kernels.variants import ALL_VARIANTS  # noqa: E402

_OPS = re.compile(r"\b(bar\.sync|bar\.arrive|wgmma\.mma_async|wgmma\.commit_group|"
                  r"wgmma\.wait_group)[^\s;]*[ \t]*([^;\n]*);")


def _compile(v, kind, pingpong, stages=None):
    unpacked = kind != "plain"
    if kind == "fused":
        k = attention.make_fused_kernel(v, True, consumers=2, kv_stages=stages,
                                        pingpong=pingpong)
        args = attention.fused_fake_args(v, True)
        obj = k.__self__
    else:
        obj = attention.make_kernel(v, unpacked, consumers=2, kv_stages=stages,
                                    pingpong=pingpong)
        k, args = obj, attention.fake_args(v, unpacked)
    art = compile_sm90a(k, *args, compile_options="--enable-tvm-ffi", keep_cubin=True)
    return art, obj


def _ops(ptx):
    """(op, operands) of the barrier and wgmma instructions in PTX text order."""
    return [(m.group(1), m.group(2).strip()) for m in _OPS.finditer(ptx)]


def _turns(ops):
    """The consumer's turns: for each named-barrier ``bar.sync`` (not the CTA-wide id 0),
    the instructions up to the next ``bar.arrive``."""
    turns, cur = [], None
    for op, arg in ops:
        if op == "bar.sync" and arg.split(",")[0].strip() != "0":
            assert cur is None, "a turn starts inside another turn"
            cur = []
        elif op == "bar.arrive" and cur is not None:
            turns.append(cur)
            cur = None
        elif cur is not None:
            cur.append(op)
    assert cur is None, "a turn is never passed on"
    return turns


def check_turns(ptx):
    ops = _ops(ptx)
    arrives = [a for op, a in ops if op == "bar.arrive"]
    # one constant arrive on barrier 1 (consumer warpgroup 1 takes the first turn), then
    # the register-addressed hand-overs
    assert arrives[0].replace(" ", "") == f"{PINGPONG_BARRIER},256"
    assert sum(1 for a in arrives if a.replace(" ", "") == f"{PINGPONG_BARRIER},256") == 1
    assert all(a.endswith("256") for a in arrives)
    turns = _turns(ops)
    # the first page's QK^T, and the steady state's QK^T + PV
    assert len(turns) == 2
    for t in turns:
        assert "wgmma.wait_group" not in t, "a warpgroup waits on its MMAs inside its turn"
        assert t[-1] == "wgmma.commit_group" and "wgmma.mma_async" in t
    assert turns[0].count("wgmma.commit_group") == 1
    assert turns[1].count("wgmma.commit_group") == 2
    # the last PV of an item follows the last hand-over, outside any turn
    last = max(i for i, (op, _) in enumerate(ops) if op == "bar.arrive")
    assert any(op == "wgmma.mma_async" for op, _ in ops[last + 1:])


@pytest.mark.parametrize("kind", ["plain", "unpacked", "fused"])
@pytest.mark.parametrize("vi", [1, 7, 12], ids=["bf16-64-2", "bf16-128-8", "fp16-128-1"])
def test_pingpong_variant_compiles_for_sm90a(vi, kind):
    from test_two_consumers_cpu import _check_no_spills

    v = ALL_VARIANTS[vi]
    art, k = _compile(v, kind, True)
    assert k.pingpong and k.consumers == 2
    assert art.has("wgmma.mma_async") and art.has("cp.async.bulk.tensor")
    assert ".reqntid 384, 1, 1" in art.ptx
    _check_no_spills(art)
    check_turns(art.ptx)
    plain, k0 = _compile(v, kind, False)
    assert not k0.pingpong
    # the same MMAs; without ping-pong no named barrier at all
    assert art.ptx.count("wgmma.mma_async") == plain.ptx.count("wgmma.mma_async")
    assert not [a for op, a in _ops(plain.ptx)
                if op == "bar.arrive" or (op == "bar.sync" and a != "0")]


@pytest.mark.parametrize("kind", ["plain", "fused"])
def test_pingpong_on_two_stages(kind):
    art, k = _compile(ALL_VARIANTS[7], kind, True, stages=2)
    assert k.pingpong and k.kv_stages == 2
    check_turns(art.ptx)


def test_default_is_one_kernel():
    v = ALL_VARIANTS[7]
    a_none, k_none = _compile(v, "plain", None)
    a_def, _ = _compile(v, "plain", attention.PINGPONG_DEFAULT)
    assert k_none.pingpong == attention.PINGPONG_DEFAULT
    assert a_none.ptx == a_def.ptx
    assert attention.check_pingpong(attention.PINGPONG_DEFAULT, 2) is None
    assert attention.check_pingpong(not attention.PINGPONG_DEFAULT, 2) == (
        not attention.PINGPONG_DEFAULT)
    assert attention.check_pingpong(None, 2) is None
    assert attention.check_pingpong(False, 1) is None


def test_pingpong_is_refused_on_64_row_kernels():
    with pytest.raises(ValueError, match="consumers=2"):
        IonAttentionSm90(cutlass.BFloat16, 128, 8, pingpong=True)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.make_kernel(ALL_VARIANTS[7], pingpong=True)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.make_fused_kernel(ALL_VARIANTS[7], pingpong=True)
    with pytest.raises(ValueError, match="tile_m=128"):
        attention.DevicePlan(item_capacity=1, group_capacity=1, partial_rows_capacity=0,
                             num_ctas=4, head_dim=128, device="cpu", pingpong=True)
    # 64-row kernels ignore an explicit False (they have nothing to turn off)
    assert attention.make_kernel(ALL_VARIANTS[7], pingpong=False).consumers == 1
    dp = attention.make_device_plan(np.array([0, 300], np.int32), np.array([300], np.int32),
                                    num_kv_heads=4, group_size=7, page_size=64, head_dim=128,
                                    device="cpu", tile_m=128, unpacked_prefill=True,
                                    pingpong=not attention.PINGPONG_DEFAULT)
    assert dp.pingpong == (not attention.PINGPONG_DEFAULT) and dp.tile_m == 128


def test_launch_picks_the_pingpong_kernel(monkeypatch):
    """``ion_attention`` hands the plan's ping-pong option to the compiled-kernel cache."""
    from test_kv_pair_cpu import default_fused_tail, record_launches

    on = not attention.PINGPONG_DEFAULT
    _, seen = record_launches(monkeypatch, unpacked_prefill=True, pingpong=on)
    # (kind, unpacked, consumers, lazy, kv_pair, kv_stages, pingpong, pin_pv_wait)
    assert seen == [("attn", True, 2, False, False, None, on, None),
                    ("fused", True, 2, False, False, None, on, None) + default_fused_tail()]


def test_precompile_builds_the_asked_kernels_for_128_row_plans_only(monkeypatch):
    import torch

    from test_kv_pair_cpu import record_precompile

    calls = record_precompile(monkeypatch)
    on = not attention.PINGPONG_DEFAULT
    attention.precompile(torch.bfloat16, 128, 28, 4, 64, fused=True, unpacked=True,
                         consumers=(1, 2), lane_combine=True, pingpong=on,
                         vec_straddle=False)  # "auto" doubles the fused: test_kv_pair_cpu
    assert sorted(calls) == sorted(
        (kind, u, c, False, False, None, on if c == 2 else None, None)
        for kind in ("attn", "fused") for u in (False, True) for c in (1, 2))


def test_bench_backends_plan_pingpong_on_128_row_tiles_only(monkeypatch):
    from test_kv_pair_cpu import record_bench_plans

    from ion_vllm.bench import kernel_runner as kr

    seen, prefill, mixed, auto = record_bench_plans(monkeypatch)
    for name, on in (("ion-auto-pp", True), ("ion-auto-np", False)):
        assert name in kr.BACKENDS
        seen.clear()
        kr.PREPARE[name](prefill, 0, "cpu", {})
        kr.PREPARE[name](mixed, 0, "cpu", {})
        assert seen == [dict(auto, tile_m=128, pingpong=on), dict(auto, tile_m=64)]
    for name, on in (("ion-auto-fused-pp", True), ("ion-auto-fused-np", False)):
        assert name in kr.BACKENDS
        seen.clear()
        kr.PREPARE[name](prefill, 0, "cpu", {})
        kr.PREPARE[name](mixed, 0, "cpu", {})
        assert seen == [dict(auto, tile_m=128, fresh_kv=True, pingpong=on),
                        dict(auto, tile_m=64, fresh_kv=True)]


def test_sweep_passes_the_option(monkeypatch):
    import torch
    from script_loader import load_script

    sweep = load_script("gpu_sweep.py", "gpu_sweep_pingpong")
    assert sweep.parse_args(["--pingpong", "on"]).pingpong == "on"
    assert sweep.parse_args([]).pingpong is None
    assert sweep._pingpong_arg("on") is True and sweep._pingpong_arg("off") is False
    assert sweep._pingpong_arg(None) is None
    seen = {}
    monkeypatch.setattr(attention, "make_device_plan", lambda *a, **k: seen.update(k))
    case = sweep.make_cases(1, 0)[0]
    sweep.make_plan(case, torch.tensor([0, 1]), torch.tensor([5]), "cpu", force_split=False,
                    fresh_kv=False, tile_m=128, pingpong=True)
    assert seen["pingpong"] is True and seen["tile_m"] == 128
