"""scripts/ncu_source_stalls.py on a small ncu source page (CSV, plain and gzip)."""

import csv
import gzip

import pytest

from tests.script_loader import load_script

mod = load_script("ncu_source_stalls.py", "ncu_source_stalls")

HEAD = ["Address", "Source", "# Samples", "Instructions Executed", "stall_barrier",
        "stall_wait", "stall_barrier (Not Issued)"]
ROWS = [["0x0", "  HGMMA.64x64x16.F32.BF16 R88", "7", "100", "0", "5", "0"],
        ["0x10", "  WARPGROUP.DEPBAR.LE gsb0, 0x0", "40", "100", "31", "2", "30"],
        ["0x20", "  WARPGROUP.DEPBAR.LE gsb0, 0x1", "12", "100", "9", "1", "9"]]


def write(path, gz):
    opener = gzip.open if gz else open
    with opener(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kernel_x"])
        w.writerow(HEAD)
        w.writerows(ROWS)


@pytest.mark.parametrize("gz", [False, True])
def test_totals_and_top_list(tmp_path, gz, capsys):
    p = str(tmp_path / ("s.csv.gz" if gz else "s.csv"))
    write(p, gz)
    name, rows = mod.read_source(p)
    assert name == "kernel_x" and len(rows) == 3
    tot = mod.stall_totals(rows)
    # the "(Not Issued)" columns are a subset of the others: not added twice
    assert tot == {"barrier": 40, "wait": 8}
    top = mod.top_instructions(rows, "barrier", 2)
    assert [(s, i) for s, i, _, _ in top] == [(31, 1), (9, 2)]
    assert mod.main([p, "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "59 samples" in out and "DEPBAR.LE gsb0, 0x0" in out and "0x1" not in out


def test_refuses_a_file_that_is_not_a_source_page(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu source page"):
        mod.read_source(str(p))
