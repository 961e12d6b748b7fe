"""scripts/kbench_phases.py: the per-phase medians read off `ion-bench kernel` summaries."""
from __future__ import annotations

import json

from script_loader import load_script

kp = load_script("kbench_phases.py", "kbench_phases")


def _rec(case, backend, it, status="ok"):
    return {"case": case, "backend": backend, "status": status, "iter_us": it}


def test_first_and_last_calls_are_read_apart(tmp_path, capsys):
    fast, slow = [780.0 + i % 3 for i in range(20)], [870.0 + i % 5 for i in range(40)]
    recs = [_rec("prefill-1x8192", "fa3", fast + slow),
            _rec("decode-32x8192", "fa3", [130.0] * 60),
            _rec("prefill-1x8192", "ion-auto", [1.0] * 60, status="failed"),
            _rec("prefill-1x8192", "short", [1.0] * 5)]
    rows = kp.phases(recs, case_filter="prefill")
    case, be, med, first, last, n = rows[0]
    assert (case, be, n) == ("prefill-1x8192", "fa3", 60)
    assert first == 781.0 and last == 872.0 and 860.0 < med < 880.0
    assert len(rows) == 1  # failed, filtered and too-short records are skipped
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"records": recs}))
    assert kp.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| prefill-1x8192 | fa3 |" in out and "| decode-32x8192 | fa3 | 130.0 |" in out
