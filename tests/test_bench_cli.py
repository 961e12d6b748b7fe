"""The ``ion-bench`` command line on the CPU: help of every subcommand, kernel case and
backend selection (a backend registered by a script included), and ``report``."""

import re
from pathlib import Path

import pytest

from ion_vllm.bench import cli, kernel_runner, report

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv,needles", [
    ([], ["kernel", "e2e", "startup", "report"]),
    (["kernel"], ["--suite", "--backends", "ion-attn", "fa3-layer", "--timing", "--list"]),
    (["e2e"], ["--workload", "NAME@DIR", "--serve", "--colocate", "--time-budget", "--dry-run"]),
    (["startup"], ["--cache-root", "--repeats", "--backends", "vllm serve"]),
    (["report"], ["dir"]),
])
def test_help(argv, needles, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert all(n in out for n in needles), out


def test_console_entry_point():
    assert re.search(r'"ion-bench = ion_vllm\.bench\.cli:main"', (ROOT / "setup.py").read_text())


def _listed(capsys):
    return [line.split()[0] for line in capsys.readouterr().out.splitlines()]


def test_kernel_list_selects_cases_and_checks_backends(capsys, monkeypatch, tmp_path):
    assert cli.main(["kernel", "--suite", "smoke", "--list"]) == 0
    assert _listed(capsys) == ["decode-32x8192-h28/4-d128", "mixed-32x8192+p2048-h28/4-d128"]
    assert cli.main(["kernel", "--case", "prefill-1x8192-h28/4-d128,decode-8x32768-h28/4-d128",
                     "--list"]) == 0
    assert _listed(capsys) == ["prefill-1x8192-h28/4-d128", "decode-8x32768-h28/4-d128"]
    assert cli.main(["kernel", "--suite", "engine", "--suite", "engine-d64", "--list"]) == 0
    assert len(_listed(capsys)) == 20
    assert cli.main(["kernel", "--case", "nope", "--list"]) == 2
    assert cli.main(["kernel", "--backends", "ion,ion-auto-fused", "--list"]) == 2
    assert "ion-auto-fused" in capsys.readouterr().out
    # a script's extra backend is accepted once registered (--register runs the script)
    monkeypatch.setattr(kernel_runner, "BACKENDS", dict(kernel_runner.BACKENDS))
    reg = tmp_path / "reg.py"
    reg.write_text("from ion_vllm.bench import kernel_runner as kr\n"
                   "kr.BACKENDS['tag-ion'] = kr.ion_backend('fused')\n")
    assert cli.main(["kernel", "--backends", "ion,tag-ion,fa3", "--list"]) == 2
    assert cli.main(["kernel", "--register", str(reg), "--backends", "ion,tag-ion,fa3",
                     "--suite", "smoke", "--list"]) == 0


def test_report_subcommand(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    report.update_summary(tmp_path, [
        {"suite": "kernel", "case": "c", "backend": "ion", "status": "ok", "median_us": 2.0},
        {"suite": "kernel", "case": "c", "backend": "fa3", "status": "ok", "median_us": 3.0}])
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "1.50x" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "plot.png").exists()
