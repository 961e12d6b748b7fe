"""scripts/ring_gather_probe.py on the CPU: its correctness check runs the worker's own
gather kernel (Triton's interpreter, in a subprocess: the interpreter is chosen when the
kernel is defined) against its torch reference, and catches a gather that drops a
block; its report prints what it measured."""

import os
import subprocess
import sys
import textwrap

from tests.script_loader import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_probe_check_passes_the_gather_and_catches_a_shifted_one():
    src = textwrap.dedent("""
        import numpy as np, sys
        sys.path.insert(0, "scripts")
        import ring_gather_probe as p
        kv, ring, gather, offs = p.build(12, 3, 32768, 8, "cpu", seed=3)
        rng = np.random.default_rng(0)
        ok = [p.check(kv, ring, gather, offs, rng) for _ in range(4)]
        # a gather that drops the job's last block (a one-block job: copies nothing)
        short = lambda r, start, g, ids: gather(r, start, g, ids[:-1])
        bad = [p.check(kv, ring, gather, offs, rng, gather_fn=short) for _ in range(4)]
        print("RESULT", all(ok), any(bad))
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", src], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=900, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "RESULT True False" in r.stdout, r.stdout


def test_the_report_shows_every_measurement():
    p = load_script("ring_gather_probe.py", "ring_gather_probe")
    res = {"device": "GPU", "tensors": 28, "page_bytes": 131072, "slot_bytes": 28 << 17,
           "checks": 20, "checks_passed": 20, "beside_blocks": 32,
           "alone": [{"blocks": 32, "us": 61.5, "gbps": 1909.0}],
           "beside": [{"workload": "decode", "alone_ms": 1.25, "priority": "high",
                       "with_ms": 1.40, "added_us": 150.0, "gather_us": 80.0,
                       "added_over_gather": 2.44}]}
    md = p.table(res)
    assert "| 32 | 61.5 | 1909 |" in md
    assert "| decode | 1.250 | high | 1.400 | 150.0 | 80.0 | 2.44 |" in md
    assert "passed: 20 of 20" in md


def test_the_copy_probe_cuts_a_batch_into_pieces_covering_the_bulk():
    """copy_contention_probe.py's batch mode (the chunked drain's issue form): pieces of
    the given size, in order, the last one short, covering every byte once."""
    p = load_script("copy_contention_probe.py", "copy_contention_probe")
    s, d, z = p.batch_pieces(1000, 5000, 300, 128)
    assert s.tolist() == [1000, 1128, 1256] and d.tolist() == [5000, 5128, 5256]
    assert z.tolist() == [128, 128, 44]
    s, d, z = p.batch_pieces(0, 0, 256 << 20, 128 << 10)
    assert len(z) == 2048 and int(z.sum()) == 256 << 20 and int(z.max()) == 128 << 10


def test_the_copy_probe_reads_a_gated_mode_as_direction_and_gate_time():
    """``gated-<dir>-<MS>``: one small copy behind a GPU spin on another stream (the
    ring piece's id copy behind the compute stream), parsed into its direction and ms;
    it has no bulk rate or compute slowdown to report."""
    p = load_script("copy_contention_probe.py", "copy_contention_probe")
    b = object.__new__(p.Bench)
    calls = []
    b.issue_gated = lambda d2h, ms: calls.append((d2h, ms))
    assert b.issue_bulk("gated-h2d-5") is None and b.issue_bulk("gated-d2h-2.5") is None
    assert calls == [(False, 5.0), (True, 2.5)]
