"""The start gate that lets benchmark engines start together and measure one at a time."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ion_vllm.bench.start_gate import GatedChild, gpu_memory_fraction, run_gated

CHILD = r"""
import json, os, sys, time
from ion_vllm.bench.start_gate import ready_then_wait
gate, name, log, startup, work = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
time.sleep(startup)                       # the "engine start"
ready_then_wait(gate, name, poll_s=0.01)
t0 = time.time(); time.sleep(work); t1 = time.time()   # the "measurement"
with open(log, "a") as f:
    f.write(json.dumps([name, t0, t1]) + "\n")
"""


def _child(tmp_path, name, startup, work, crash=False):
    code = "import sys; sys.exit(3)" if crash else CHILD
    return GatedChild(name, [sys.executable, "-c", code, str(tmp_path / "gate"), name,
                             str(tmp_path / "log.jsonl"), str(startup), str(work)],
                      dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def _log(tmp_path):
    with open(tmp_path / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def test_measurements_run_one_at_a_time_in_the_given_order(tmp_path):
    # the last child is the first to be ready: it must still wait for its turn
    kids = [_child(tmp_path, "a", 0.6, 0.3), _child(tmp_path, "b", 0.3, 0.3),
            _child(tmp_path, "c", 0.0, 0.3)]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None)
    assert rcs == {"a": 0, "b": 0, "c": 0}
    assert done == [("a", 0), ("b", 0), ("c", 0)]
    log = _log(tmp_path)
    assert [r[0] for r in log] == ["a", "b", "c"]
    for prev, nxt in zip(log, log[1:]):
        assert nxt[1] >= prev[2], "two measurements overlapped"


def test_startups_overlap(tmp_path):
    """Three 1 s starts must not take 3 s: they run concurrently."""
    import time

    kids = [_child(tmp_path, n, 1.0, 0.0) for n in "xyz"]
    t0 = time.monotonic()
    run_gated(kids, str(tmp_path / "gate"), poll_s=0.01, log=lambda s: None)
    assert time.monotonic() - t0 < 2.5


def test_a_child_that_dies_before_ready_is_reported_and_the_rest_go_on(tmp_path):
    kids = [_child(tmp_path, "a", 0.0, 0.1, crash=True), _child(tmp_path, "b", 0.0, 0.1)]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None)
    assert rcs == {"a": 3, "b": 0}
    assert done == [("a", 3), ("b", 0)]
    assert [r[0] for r in _log(tmp_path)] == ["b"]


def test_gpu_memory_fraction():
    assert gpu_memory_fraction(1) == 0.9
    assert gpu_memory_fraction(2) == 0.45
    assert gpu_memory_fraction(3) == 0.3
    assert gpu_memory_fraction(4) == 0.22
    with pytest.raises(ValueError):
        gpu_memory_fraction(0)


def test_engine_env_gives_each_engine_its_own_compile_cache(tmp_path):
    from ion_vllm.bench.start_gate import engine_env

    a, b = engine_env(str(tmp_path), "a"), engine_env(str(tmp_path), "b", {"X": "1"})
    assert a["VLLM_CACHE_ROOT"] != b["VLLM_CACHE_ROOT"]
    assert a["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and b == {
        "X": "1", "VLLM_CACHE_ROOT": str(tmp_path / "cache-b")}
    assert a.get("PATH") == os.environ.get("PATH")  # the base is the process environment
