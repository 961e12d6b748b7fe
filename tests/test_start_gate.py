"""The start gate that lets benchmark engines start together and measure one at a time."""

from __future__ import annotations

import json
import os
import sys

import pytest

import script_loader  # noqa: F401  (puts scripts/ on sys.path)
from start_gate import GatedChild, gpu_memory_fraction, run_gated

CHILD = r"""
import json, os, sys, time
from start_gate import ready_then_wait
gate, name, log = sys.argv[1], sys.argv[2], sys.argv[3]
startup, work, rounds = float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
s0 = time.time(); time.sleep(startup); s1 = time.time()   # the "engine start"
with open(log, "a") as f:
    f.write(json.dumps(["start:" + name, s0, s1]) + "\n")
for r in range(rounds):
    ready_then_wait(gate, name, r, poll_s=0.01)
    t0 = time.time(); time.sleep(work); t1 = time.time()   # the "measurement"
    with open(log, "a") as f:
        f.write(json.dumps([f"{name}{r}", t0, t1]) + "\n")
"""


def _child(tmp_path, name, startup, work, crash=False, rounds=1):
    code = "import sys; sys.exit(3)" if crash else CHILD
    return GatedChild(name, [sys.executable, "-c", code, str(tmp_path / "gate"), name,
                             str(tmp_path / "log.jsonl"), str(startup), str(work),
                             str(rounds)],
                      dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def _log(tmp_path, starts=False):
    """Measurement records [label, t0, t1] in time order (start-up records with
    ``starts``)."""
    with open(tmp_path / "log.jsonl") as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if starts == r[0].startswith("start:")]


def _no_overlaps(recs):
    recs = sorted(recs, key=lambda r: r[1])
    for prev, nxt in zip(recs, recs[1:]):
        assert nxt[1] >= prev[2], f"{prev[0]} and {nxt[0]} overlapped"


def test_measurements_run_one_at_a_time_in_the_given_order(tmp_path):
    # the last child is the first to be ready: it must still wait for its turn
    kids = [_child(tmp_path, "a", 0.4, 0.15), _child(tmp_path, "b", 0.2, 0.15),
            _child(tmp_path, "c", 0.0, 0.15)]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None)
    assert rcs == {"a": 0, "b": 0, "c": 0}
    assert done == [("a", 0), ("b", 0), ("c", 0)]
    log = _log(tmp_path)
    assert [r[0] for r in log] == ["a0", "b0", "c0"]
    _no_overlaps(log)


def test_nothing_measures_while_another_engine_starts(tmp_path):
    """The first child is ready at once, the last after 0.5 s: the first measurement
    must still wait until every start-up is over (it would share the GPU and CPUs with
    the others' torch.compile and graph capture)."""
    kids = [_child(tmp_path, "a", 0.0, 0.05), _child(tmp_path, "b", 0.25, 0.05),
            _child(tmp_path, "c", 0.5, 0.05)]
    run_gated(kids, str(tmp_path / "gate"), poll_s=0.01, log=lambda s: None)
    last_start_end = max(r[2] for r in _log(tmp_path, starts=True))
    first = min(r[1] for r in _log(tmp_path))
    assert first >= last_start_end


def test_rounds_interleave_the_children(tmp_path):
    """With 3 rounds the measurements run a0 b0 a1 b1 a2 b2, never two at once."""
    kids = [_child(tmp_path, n, 0.2 if n == "a" else 0.0, 0.05, rounds=3) for n in "ab"]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None, rounds=3)
    assert rcs == {"a": 0, "b": 0} and done == [("a", 0), ("b", 0)]
    log = _log(tmp_path)
    assert [r[0] for r in sorted(log, key=lambda r: r[1])] == ["a0", "b0", "a1", "b1",
                                                                "a2", "b2"]
    _no_overlaps(log)


def test_a_child_that_stops_early_is_reaped_and_the_others_finish(tmp_path):
    """A child that measures 1 of 3 rounds and exits: the others run all three."""
    kids = [_child(tmp_path, "a", 0.0, 0.05, rounds=1),
            _child(tmp_path, "b", 0.0, 0.05, rounds=3)]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None, rounds=3)
    assert rcs == {"a": 0, "b": 0} and done == [("a", 0), ("b", 0)]
    assert [r[0] for r in sorted(_log(tmp_path), key=lambda r: r[1])] == ["a0", "b0", "b1",
                                                                           "b2"]


def test_rounds_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        run_gated([], str(tmp_path), rounds=0)


def test_startups_overlap(tmp_path):
    """Three 0.6 s starts must not take 1.8 s: they run concurrently."""
    import time

    kids = [_child(tmp_path, n, 0.6, 0.0) for n in "xyz"]
    t0 = time.monotonic()
    run_gated(kids, str(tmp_path / "gate"), poll_s=0.01, log=lambda s: None)
    assert time.monotonic() - t0 < 1.6


def test_a_child_that_dies_before_ready_is_reported_and_the_rest_go_on(tmp_path):
    kids = [_child(tmp_path, "a", 0.0, 0.1, crash=True), _child(tmp_path, "b", 0.0, 0.1)]
    done = []
    rcs = run_gated(kids, str(tmp_path / "gate"), on_done=lambda n, rc: done.append((n, rc)),
                    poll_s=0.01, log=lambda s: None)
    assert rcs == {"a": 3, "b": 0}
    assert done == [("a", 3), ("b", 0)]
    assert [r[0] for r in _log(tmp_path)] == ["b0"]


def test_gpu_memory_fraction():
    assert gpu_memory_fraction(1) == 0.9
    assert gpu_memory_fraction(2) == 0.45
    assert gpu_memory_fraction(3) == 0.3
    assert gpu_memory_fraction(4) == 0.22
    with pytest.raises(ValueError):
        gpu_memory_fraction(0)


def test_engine_env_gives_each_engine_its_own_compile_cache(tmp_path):
    from start_gate import engine_env

    a, b = engine_env(str(tmp_path), "a"), engine_env(str(tmp_path), "b", {"X": "1"})
    assert a["VLLM_CACHE_ROOT"] != b["VLLM_CACHE_ROOT"]
    assert a["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and b == {
        "X": "1", "VLLM_CACHE_ROOT": str(tmp_path / "cache-b")}
    assert a.get("PATH") == os.environ.get("PATH")  # the base is the process environment


def test_rotated_rounds_start_at_the_next_child_each_round(tmp_path):
    """rotate=True: a0 b0 c0, b1 c1 a1, c2 a2 b2 (every child in every place once over
    three rounds), still one at a time; rotate=False keeps the given order."""
    kids = [_child(tmp_path, n, 0.0, 0.05, rounds=3) for n in "abc"]
    rcs = run_gated(kids, str(tmp_path / "gate"), poll_s=0.01, log=lambda s: None,
                    rounds=3, rotate=True)
    assert rcs == {"a": 0, "b": 0, "c": 0}
    log = _log(tmp_path)
    assert [r[0] for r in sorted(log, key=lambda r: r[1])] == [
        "a0", "b0", "c0", "b1", "c1", "a1", "c2", "a2", "b2"]
    _no_overlaps(log)
