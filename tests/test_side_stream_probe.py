"""CPU checks of scripts/side_stream_probe.py (the GPU probe of the thirtieth session's
reading: a kernel run once on a second stream slows every later CUDA-graph replay): its
report, its refusals where CUDA or the graph names are wrong, and its Triton add compiled
for sm_90 with and without programmatic dependent launch."""

import re

import pytest
import torch
from script_loader import load_script

probe = load_script("side_stream_probe.py", "side_stream_probe_script")


def test_side_stream_probe_report_and_its_refusal_without_a_gpu(monkeypatch, capsys):
    """The probe's table gives each read's difference from the same graph's ``base``
    (worked out here; rows of the thirty-first session's record have no ``graph`` and read
    as "torch"), and the script refuses with exit code 2, not a traceback, where CUDA is
    missing."""
    rows = [{"state": "base", "us_per_kernel": 1.25, "p10": 1.2, "p90": 1.3},
            {"graph": "pdl", "state": "base", "us_per_kernel": 2.0, "p10": 1.9, "p90": 2.1},
            {"state": "after-copy", "us_per_kernel": 1.25, "p10": 1.2, "p90": 1.4},
            {"state": "after-kernel", "us_per_kernel": 1.625, "p10": 1.6, "p90": 1.7},
            {"graph": "pdl", "state": "after-kernel", "us_per_kernel": 2.5, "p10": 2.4,
             "p90": 2.6}]
    lines = probe.report_lines(rows)
    assert lines[0].startswith("| graph | state |")
    assert lines[2] == "| torch | base | 1.250 | 1.200 | 1.300 | +0.000 |"
    assert lines[4].endswith("| +0.000 |") and lines[5].endswith("| +0.375 |")
    assert lines[6] == "| pdl | after-kernel | 2.500 | 2.400 | 2.600 | +0.500 |"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.main(["--reps", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_graph_names_are_checked_before_anything_runs(capsys):
    assert probe.parse_graphs("torch, pdl,plain") == ["torch", "pdl", "plain"]
    for bad in ("pdl,cuda", "", ","):
        with pytest.raises(ValueError, match="--graphs"):
            probe.parse_graphs(bad)
    with pytest.raises(SystemExit) as e:
        probe.main(["--graphs", "torch,graphs"])
    assert e.value.code == 2 and "not among torch, pdl, plain" in capsys.readouterr().err


@pytest.mark.parametrize("pdl", [True, False])
def test_the_triton_add_compiles_for_sm90_with_and_without_pdl(pdl):
    """Compiled for Hopper without a GPU: with PDL the add waits on its predecessor
    (``griddepcontrol.wait``) before its loads and lets its dependent launch
    (``griddepcontrol.launch_dependents``) before its store; without, neither."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=probe._add_kernel_fn(),
                    constexprs={"BLOCK": probe.ADD_BLOCK, "PDL": pdl},
                    signature={"a_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32",
                               "n": "i32", "BLOCK": "constexpr", "PDL": "constexpr"})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "launch_pdl": pdl}).asm["ptx"]
    assert ".target sm_90" in ptx
    body = ptx[ptx.index(".entry"):]
    wait, dep = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
    load, store = re.search(r"ld\.global", body), re.search(r"st\.global", body)
    assert load and store
    if pdl:
        assert 0 <= wait < load.start() and load.start() < dep < store.start()
    else:
        assert wait < 0 and dep < 0
    assert probe.triton_grid(1 << 20) == (1 << 20) // probe.ADD_BLOCK
    assert probe.triton_grid(probe.ADD_BLOCK + 1) == 2
