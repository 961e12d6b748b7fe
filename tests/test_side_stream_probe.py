"""CPU checks of scripts/side_stream_probe.py (the GPU probe of the thirtieth session's
reading: a kernel run once on a second stream slows every later CUDA-graph replay): its
report, and its refusal where CUDA is missing."""

import torch
from script_loader import load_script

probe = load_script("side_stream_probe.py", "side_stream_probe_script")


def test_side_stream_probe_report_and_its_refusal_without_a_gpu(monkeypatch, capsys):
    """The probe's table gives each read's difference from ``base`` (worked out here), and
    the script refuses with exit code 2, not a traceback, where CUDA is missing."""
    rows = [{"state": "base", "us_per_kernel": 1.25, "p10": 1.2, "p90": 1.3},
            {"state": "after-copy", "us_per_kernel": 1.25, "p10": 1.2, "p90": 1.4},
            {"state": "after-kernel", "us_per_kernel": 1.625, "p10": 1.6, "p90": 1.7}]
    lines = probe.report_lines(rows)
    assert lines[2] == "| base | 1.250 | 1.200 | 1.300 | +0.000 |"
    assert lines[3].endswith("| +0.000 |") and lines[4].endswith("| +0.375 |")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.main(["--reps", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
