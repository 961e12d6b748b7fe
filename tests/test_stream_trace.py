"""CPU checks of the per-stream trace report (ion_vllm/bench/stream_trace.py) and of the KV
tier benchmark's profiled wave (scripts/kv_tier_bench.py --profile-dir), on synthetic
Kineto traces."""

import gzip
import types
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
    rep = bench.profile_summary(str(tmp_path / "prof"), "ion", timeline_dir=str(tmp_path))
    assert rep["compute_stream"] == "7" and rep["trace"].endswith("b.pt.trace.json.gz")
    assert bench.profile_summary(str(tmp_path / "prof"), "native") is None
    # every gap size: 15-200 and 230-400 us (the 0-15 and 200-230 kernels are back to back)
    assert rep["gaps"]["idle_us"] == pytest.approx(355.0) and rep["gaps"]["gaps"] == 2
    # the wave's kernels kept in a small file that gives the same gaps back
    from ion_vllm.bench import gap_profile
    assert rep["timeline"] == "timeline-ion.npz"
    back = gap_profile.load_timeline(str(tmp_path / "timeline-ion.npz"))
    assert gap_profile.summarize_gaps(back, "7") == rep["gaps"]
    all_lines = bench.profile_lines([{"config": "ion", "profile": rep},
                                     {"config": "native", "profile": None}])
    n_gap = len(gap_profile.markdown_lines([("ion", rep["gaps"])]))
    assert n_gap == 18 and all_lines[-n_gap:] == gap_profile.markdown_lines(
        [("ion", rep["gaps"])])
    lines = all_lines[:-n_gap]
    assert len(lines) == 18 and lines[5].startswith("| ion | 0.4 | 0.145 | 2 (0.4) |")
    assert "0.0 / 0.1 / 0.0" in lines[5]  # other streams: kernels 30 us, HtoD 50, DtoH 20
    assert "gemm 1.500" in lines[5]
    # the host split: two gaps of 20 us or more (185, 170 us), no launch events here
    assert lines[11] == "| ion | 2 (0.4) | 0 (0.0) | 0 (0.0) | - | - |"
    # and by the side work near them (the DtoH copy near both, the gather near the second)
    assert lines[-1] == ("| ion | 2 (0.4) | 0 (0.0) | 21 DtoH: 2, 0.4, of 1; "
                         "20 kernel: 1, 0.2, of 1 |")
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

    def fake_run_gated(children, d, on_done=None, rounds=1, rotate=False, **kw):
        seen.append((sorted(c.name for c in children), rounds, rotate))
        return {}

    monkeypatch.setattr(start_gate, "run_gated", fake_run_gated)
    base = {"repeats": 2, "profile_dir": None}
    bench.run_colocated(base, ["ion", "native-default"], lambda r: None)
    bench.run_colocated({**base, "profile_dir": "/tmp/p"}, ["ion"], lambda r: None,
                        rotate=False)
    # the order rotates by default (no config always first; 2026-12-06)
    assert seen == [(["ion", "native-default"], 2, True), (["ion"], 3, False)]


def _host_trace():
    """Compute stream 7: k1 [0, 10), k2 [60, 70) launched at 40 (host late 30 us of a 50 us
    gap), k3 [100, 110) launched at 5 (a device-side gap of 30 us), k4 [200, 210) with no
    launch event (unknown), k5 [215, 220) after a 5 us gap (under the threshold).  On the
    host: an ion_kv:get_finished range [12, 38) holding a cudaEventQuery [20, 22), and a
    cudaStreamSynchronize [0, 14) that overlaps the late window's first 4 us."""
    rt = "cuda_runtime"
    return {"traceEvents": [
        _ev("kernel", "k1", 0.0, 10.0, 7, correlation=1),
        _ev("kernel", "k2", 60.0, 10.0, 7, correlation=2),
        _ev("kernel", "k3", 100.0, 10.0, 7, correlation=3),
        _ev("kernel", "k4", 200.0, 10.0, 7, correlation=99),
        _ev("kernel", "k5", 215.0, 5.0, 7, correlation=5),
        _ev("kernel", "side", 20.0, 30.0, 20, correlation=6),
        {"ph": "X", "cat": rt, "name": "cudaLaunchKernel", "ts": 0.0, "dur": 1.0, "tid": 1,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": rt, "name": "cudaLaunchKernel", "ts": 40.0, "dur": 2.0, "tid": 1,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": rt, "name": "cudaGraphLaunch", "ts": 5.0, "dur": 3.0, "tid": 1,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": rt, "name": "cudaLaunchKernel", "ts": 150.0, "dur": 1.0, "tid": 1,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": rt, "name": "cudaLaunchKernel", "ts": 9.0, "dur": 1.0, "tid": 2,
         "args": {"correlation": 6}},
        {"ph": "X", "cat": rt, "name": "cudaStreamSynchronize", "ts": 0.0, "dur": 14.0,
         "tid": 1, "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "ion_kv:get_finished", "ts": 12.0,
         "dur": 26.0, "tid": 1},
        {"ph": "X", "cat": rt, "name": "cudaEventQuery", "ts": 20.0, "dur": 2.0, "tid": 1,
         "args": {}},
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0.0,
         "dur": 300.0, "tid": 1},
    ]}


def test_host_waits_splits_gaps_between_host_and_device():
    t = _host_trace()
    acts = st.gpu_activities(t)
    h = st.host_waits(acts, st.host_events(t), "7", gap_us=20.0)
    assert (h["gaps"], h["host_late"], h["device"], h["unknown"]) == (3, 1, 1, 1)
    assert h["gap_us"] == pytest.approx(50.0 + 30.0 + 90.0)
    # k2's gap [10, 60): launched at 40, so the host was late 30 us; the 20 us after it
    # (launch latency) counts as the device's, with k3's whole 30 us gap
    assert h["host_late_us"] == pytest.approx(30.0)
    assert h["device_us"] == pytest.approx(20.0 + 30.0)
    assert h["unknown_us"] == pytest.approx(90.0)
    during = {d["name"]: d for d in h["during_host_late"]}
    assert during["ion_kv:get_finished"]["us"] == pytest.approx(26.0)
    assert during["cudaStreamSynchronize"]["us"] == pytest.approx(4.0)
    assert during["cudaEventQuery"]["us"] == pytest.approx(2.0)
    assert during["execute_model"]["us"] == pytest.approx(30.0)
    assert "cudaGraphLaunch" not in during  # [5, 8): before the late window
    assert h["during_host_late"][0]["name"] == "execute_model"  # heaviest first
    api = {a["name"]: a for a in h["api_calls"]}
    assert api["cudaLaunchKernel"]["count"] == 4
    assert api["cudaStreamSynchronize"]["us"] == pytest.approx(14.0)
    assert [r["name"] for r in h["ion_ranges"]] == ["ion_kv:get_finished"]
    assert {a["name"] for a in h["annotations"]} == {"execute_model", "ion_kv:get_finished"}
    rep = st.summarize(t, host_gap_us=20.0)
    assert rep["host"]["host_late_us"] == pytest.approx(30.0)
    assert st.summarize({"traceEvents": []})["host"] is None


def test_host_waits_threshold_and_overlapping_kernels():
    """A kernel ending inside an earlier, longer one opens no gap; a gap just under the
    threshold is not counted."""
    t = {"traceEvents": [
        _ev("kernel", "long", 0.0, 100.0, 7, correlation=1),
        _ev("kernel", "short", 10.0, 5.0, 7, correlation=2),
        _ev("kernel", "next", 119.0, 5.0, 7, correlation=3),
    ]}
    acts = st.gpu_activities(t)
    h = st.host_waits(acts, st.host_events(t), "7", gap_us=20.0)
    assert h["gaps"] == 0
    h = st.host_waits(acts, st.host_events(t), "7", gap_us=19.0)
    assert (h["gaps"], h["unknown"]) == (1, 1) and h["gap_us"] == pytest.approx(19.0)


def test_bench_profile_lines_render_the_host_split():
    rep = st.summarize(_host_trace(), host_gap_us=20.0)
    lines = bench.profile_lines([{"config": "ion", "profile": rep}])
    i = next(k for k, ln in enumerate(lines) if ln.startswith("| config | gaps |"))
    row = lines[i + 2]
    assert row.startswith("| ion | 3 (0.2) | 1 (0.0) | 1 (0.1) | execute_model 0.0;")
    assert row.endswith("| get_finished 1x26 |")


def test_a_profile_only_run_reports_its_profile_and_no_timed_numbers(tmp_path):
    """--repeats 0 --profile-dir: a config's result has no repeats (every averaged field
    None, no min/max), results.md still renders with its profiled-wave table, and no bar
    is judged from it."""
    res = bench.combine_repeats("ion-ringsmall", [])
    assert res["repeats"] == 0 and res["total_tok_s"] is None
    assert res["total_tok_s_min"] is None and res["tier_metrics"] == {}
    res["profile"] = st.summarize(_trace())
    args = types.SimpleNamespace(model="m", attention_backend="ION", host_gib=1.0,
                                 conversations=2, turns=1, context_len=8, user_len=1,
                                 max_tokens=1, wave=1)
    lines = bench.write_results(str(tmp_path), {"meta": 1}, [res], args, 1 << 20, 4 << 20)
    md = (tmp_path / "results.md").read_text()
    assert "| ion-ringsmall | - |" in md and "Profiled wave" in md
    assert "| ion-ringsmall | 0.4 | 0.145 | 2 (0.4) |" in md
    assert not any("PASS" in x or "FAIL" in x for x in lines)


def test_gaps_are_matched_with_the_side_work_near_them():
    """Compute stream 7 idles 15-200 us and 230-400 us.  With a 100 us lead, the first gap
    has the DtoH copy (190-210) near it; the second has the DtoH copy and the gather
    (212-242); the HtoD copy (415-465) comes after both gaps and is near none."""
    acts = st.gpu_activities(_trace())
    r = st.gaps_near_side_work(acts, "7", gap_us=20.0, lead_us=100.0)
    assert (r["gaps"], r["gap_us"], r["alone"]) == (2, 355.0, 0)
    by = {(x["stream"], x["kind"]): (x["gaps"], x["gap_us"], x["pieces"])
          for x in r["by_side"]}
    assert by == {("21", "DtoH"): (2, 355.0, 1), ("20", "kernel"): (1, 170.0, 1)}
    assert r["by_side"][0]["kind"] == "DtoH"  # most gap time first
    # no lead: the copy runs into the first gap (190-210 against 15-200) but ended before
    # the second (230-400), into which only the gather runs (212-242)
    r0 = st.gaps_near_side_work(acts, "7", gap_us=20.0, lead_us=0.0)
    assert {(x["stream"], x["kind"]): x["gaps"] for x in r0["by_side"]} == \
        {("21", "DtoH"): 1, ("20", "kernel"): 1}
    assert st.gaps_near_side_work(acts, "7", gap_us=400.0)["gaps"] == 0
    # with the side streams removed, every gap is alone
    lone = [a for a in acts if a["stream"] == "7"]
    r = st.gaps_near_side_work(lone, "7")
    assert (r["alone"], r["alone_us"], r["by_side"]) == (2, 355.0, [])


def _prompt_cfg(**kw):
    return {"seed": 0, "wave": 2, "conversations": 4, "vocab": 1000, "context_len": 12,
            "user_len": 3, **kw}


def test_the_profiled_wave_of_turn_1_is_one_wave_of_cold_prompts():
    calls = []
    p = bench.profile_prompts(_prompt_cfg(), lambda ps: calls.append(ps) or [])
    assert calls == [] and len(p) == 2 and all(len(x) == 15 for x in p)
    assert p == bench.profile_prompts(_prompt_cfg(), None)  # the same draw every time
    assert p != bench.profile_prompts(_prompt_cfg(seed=1), None)


def test_a_later_profiled_turn_runs_the_earlier_turns_over_two_waves_first():
    """--profile-turn 3: turns 1 and 2 of four conversations run unprofiled as two waves
    of two (the second pushes the first out of HBM); the profiled prompts are the first
    wave's turn 3: each holds its conversation's earlier prompts and answers in order."""
    calls = []

    def generate(prompts):
        calls.append([list(x) for x in prompts])
        return [[7000 + len(calls) * 10 + i] * 5 for i in range(len(prompts))]

    p = bench.profile_prompts(_prompt_cfg(profile_turn=3), generate)
    assert [len(c) for c in calls] == [2, 2, 2, 2]  # 2 turns x 2 waves
    assert [len(x) for x in calls[0]] == [15, 15] and [len(x) for x in calls[2]] == [23, 23]
    assert len(p) == 2 and all(len(x) == 15 + 5 + 3 + 5 + 3 for x in p)
    for i in range(2):
        turn1, turn2 = calls[0][i], calls[2][i]
        assert turn2[:15] == turn1 and turn2[15:20] == [7010 + i] * 5
        assert p[i][:23] == turn2 and p[i][23:28] == [7030 + i] * 5
    # the second wave's conversations are others, and none is profiled
    assert all(c[:12] != p[0][:12] and c[:12] != p[1][:12] for c in calls[1])


def test_profile_turn_is_refused_outside_the_turns_the_engine_is_sized_for():
    import subprocess
    import sys
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts",
                        "kv_tier_bench.py")
    r = subprocess.run([sys.executable, path, "/m", "--turns", "2", "--profile-turn", "3",
                        "--profile-dir", "/tmp/p"], capture_output=True, text=True,
                       check=False, timeout=120)
    assert r.returncode == 2 and "--profile-turn must be in 1..--turns" in r.stderr
