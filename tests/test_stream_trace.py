"""CPU checks of the per-stream trace report (ion_vllm/bench/stream_trace.py) and of the KV
tier benchmark's profiled wave (scripts/kv_tier_bench.py --profile-dir), on synthetic
Kineto traces."""

import gzip
import json
import os

import pytest
from script_loader import load_script

from ion_vllm.bench import stream_trace as st

bench = load_script("kv_tier_bench.py", "kv_tier_bench_profile_script")


def _ev(cat, name, ts, dur, stream, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0,
            "tid": stream, "args": {"stream": stream, **args}}


def _trace():
    """Compute stream 7: gemm x4 (10 us alone, 15 us when a side stream is busy), attn x2
    (5 us); stream 20: a 30 us gather kernel; stream 21: a DtoH copy of 4 MiB and an
    HtoD copy of 1 MiB.  A CPU op and an instant event are not GPU activity."""
    return {"traceEvents": [
        _ev("kernel", "gemm", 0.0, 10.0, 7),
        _ev("kernel", "attn", 10.0, 5.0, 7),
        _ev("kernel", "gemm", 200.0, 15.0, 7),       # overlaps the DtoH copy
        _ev("kernel", "gemm", 215.0, 15.0, 7),       # overlaps the gather
        _ev("kernel", "attn", 400.0, 5.0, 7),
        _ev("kernel", "gemm", 405.0, 10.0, 7),       # touches the HtoD copy's start only
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 190.0, 20.0, 21, bytes=4 << 20),
        _ev("kernel", "_gather_pages_kernel", 212.0, 30.0, 20),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 415.0, 50.0, 21, bytes=1 << 20),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3.0},
    ]}


def test_activities_kinds_streams_and_bytes():
    acts = st.gpu_activities(_trace())
    assert len(acts) == 9
    assert [a["start"] for a in acts] == sorted(a["start"] for a in acts)
    kinds = {a["name"]: a["kind"] for a in acts}
    assert kinds["Memcpy DtoH (Device -> Pinned)"] == "DtoH"
    assert kinds["Memcpy HtoD (Pinned -> Device)"] == "HtoD"
    assert kinds["_gather_pages_kernel"] == "kernel"
    assert st.compute_stream(acts) == "7"
    rows = {r["stream"]: r for r in st.stream_table(acts)}
    assert rows["7"]["kernel_count"] == 6 and rows["7"]["kernel_us"] == pytest.approx(60.0)
    assert rows["21"]["DtoH_bytes"] == 4 << 20 and rows["21"]["HtoD_bytes"] == 1 << 20
    assert rows["21"]["DtoH_us"] == pytest.approx(20.0)
    # busy is the union: the compute stream's first two kernels are back to back
    assert rows["7"]["busy_us"] == pytest.approx(60.0)


def test_overlap_slowdown_separates_launches_beside_other_streams():
    acts = st.gpu_activities(_trace())
    ov = {o["kernel"]: o for o in st.overlap_slowdown(acts, "7")}
    g = ov["gemm"]
    assert (g["busy_count"], g["alone_count"]) == (2, 2)
    assert g["busy_mean_us"] == pytest.approx(15.0) and g["alone_mean_us"] == pytest.approx(10.0)
    assert g["ratio"] == pytest.approx(1.5)
    a = ov["attn"]
    assert a["busy_count"] == 0 and a["ratio"] is None
    assert list(ov) == ["gemm", "attn"]  # heaviest first


def test_summary_busy_and_gaps_of_the_compute_stream():
    rep = st.summarize(_trace(), gap_us=100.0)
    c = rep["compute"]
    assert rep["compute_stream"] == "7"
    assert c["span_us"] == pytest.approx(415.0)
    assert c["busy_us"] == pytest.approx(60.0)
    assert c["long_gaps"] == 2 and c["long_gap_us"] == pytest.approx(185.0 + 170.0)
    empty = st.summarize({"traceEvents": []})
    assert empty["compute_stream"] is None and empty["overlap"] == []


def test_load_trace_reads_gzip_and_bare_lists(tmp_path):
    t = _trace()
    p = tmp_path / "x.pt.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(t, f)
    assert st.load_trace(str(p)) == t
    q = tmp_path / "y.json"
    q.write_text(json.dumps(t["traceEvents"]))
    assert st.load_trace(str(q)) == t


def test_bench_profile_summary_takes_the_newest_trace_and_renders(tmp_path):
    d = tmp_path / "prof" / "ion" / "sub"
    d.mkdir(parents=True)
    old = d / "a.pt.trace.json.gz"
    with gzip.open(old, "wt") as f:
        json.dump({"traceEvents": []}, f)
    os.utime(old, (1, 1))
    new = d / "b.pt.trace.json.gz"
    with gzip.open(new, "wt") as f:
        json.dump(_trace(), f)
    rep = bench.profile_summary(str(tmp_path / "prof"), "ion")
    assert rep["compute_stream"] == "7" and rep["trace"].endswith("b.pt.trace.json.gz")
    assert bench.profile_summary(str(tmp_path / "prof"), "native") is None
    lines = bench.profile_lines([{"config": "ion", "profile": rep},
                                 {"config": "native", "profile": None}])
    assert len(lines) == 6 and lines[-1].startswith("| ion | 0.4 | 0.145 | 2 (0.4) |")
    assert "0.0 / 0.1 / 0.0" in lines[-1]  # other streams: kernels 30 us, HtoD 50, DtoH 20
    assert "gemm 1.500" in lines[-1]
    assert bench.profile_lines([{"config": "ion"}]) == []


def test_bench_profiler_config_records_a_window_of_steps(tmp_path):
    cfg = {"profile_dir": str(tmp_path), "name": "ion", "profile_delay": 400,
           "profile_steps": 300}
    pc = bench.profiler_config(cfg)
    assert pc.profiler == "torch" and pc.torch_profiler_dir == str(tmp_path / "ion")
    assert (pc.delay_iterations, pc.max_iterations) == (400, 300)
    assert pc.ignore_frontend and not pc.torch_profiler_with_stack


def test_colocated_profiling_gets_a_gated_round_of_its_own(monkeypatch):
    """--colocate --profile-dir: the parent runs repeats + 1 gated rounds, so that each
    config's profiled wave runs alone, never beside another config's timed repeat."""
    from ion_vllm.bench import start_gate

    seen = []

    def fake_run_gated(children, d, on_done=None, rounds=1, **kw):
        seen.append((sorted(c.name for c in children), rounds))
        return {}

    monkeypatch.setattr(start_gate, "run_gated", fake_run_gated)
    base = {"repeats": 2, "profile_dir": None}
    bench.run_colocated(base, ["ion", "native-default"], lambda r: None)
    bench.run_colocated({**base, "profile_dir": "/tmp/p"}, ["ion"], lambda r: None)
    assert seen == [(["ion", "native-default"], 2), (["ion"], 3)]
