"""CPU checks of the KV-tier benchmark's wall-time breakdown: engine steps and tokens from
vLLM's histograms, prompt tokens by source, and the NVML GPU-busy sampler
(``scripts/gpu_busy.py``).  They say where a slower config's extra wall time goes:
more steps, longer steps with the GPU busy, or the GPU idle."""

import threading
import time
from types import SimpleNamespace

import pytest
from script_loader import load_script

import script_loader  # noqa: F401  (puts scripts/ on sys.path)
from gpu_busy import GpuBusySampler, summarize
from ion_vllm.bench.offload_configs import prometheus_sums

bench = load_script("kv_tier_bench.py", "kv_tier_bench_steps_script")


def test_prometheus_sums_reads_histograms_and_splits_sources():
    from prometheus_client import Counter, Histogram

    h = Histogram("vllm:ion_test_iter_tokens", "tokens a step", ["engine"])
    for e, v in (("0", 3.0), ("0", 5.0), ("1", 7.5)):
        h.labels(e).observe(v)
    c = Counter("vllm:ion_test_by_source", "tokens", ["engine", "source"])
    c.labels("0", "local_compute").inc(10)
    c.labels("1", "local_compute").inc(5)
    c.labels("0", "external_kv_transfer").inc(64)
    m = prometheus_sums()
    assert m["vllm:ion_test_iter_tokens_sum"] == pytest.approx(15.5)
    assert m["vllm:ion_test_iter_tokens_count"] == 3.0
    assert not any(k.startswith("vllm:ion_test_iter_tokens") and "bucket" in k for k in m)
    assert m["vllm:ion_test_by_source"] == 79.0  # all labels, as before
    assert m["vllm:ion_test_by_source[local_compute]"] == 15.0
    assert m["vllm:ion_test_by_source[external_kv_transfer]"] == 64.0


def test_engine_step_stats_from_metric_deltas():
    d = {"vllm:iteration_tokens_total_count": 400.0,
         "vllm:iteration_tokens_total_sum": 100_000.0,
         "vllm:prompt_tokens_by_source[local_compute]": 60_000.0,
         "vllm:prompt_tokens_by_source[local_cache_hit]": 1_000.0,
         "vllm:prompt_tokens_by_source[external_kv_transfer]": 30_000.0,
         "vllm:request_queue_time_seconds_sum": 12.5}
    s = bench.engine_step_stats(d, wall=8.0)
    assert s["engine_steps"] == 400 and s["step_tokens"] == 100_000
    assert s["tokens_per_step"] == 250.0 and s["ms_per_step"] == 20.0
    assert (s["prompt_computed"], s["prompt_gpu_cache"], s["prompt_tier"]) == (60_000, 1_000,
                                                                              30_000)
    assert s["queue_s"] == 12.5 and s["prefill_s"] == 0.0
    empty = bench.engine_step_stats({}, wall=1.0)
    assert empty["engine_steps"] == 0 and empty["ms_per_step"] is None


def test_step_table_shows_means_and_skips_old_results(tmp_path):
    def run(seed, steps, busy):
        return {"config": "ion", "seed": seed, "requests": 1, "wall_s": 10.0 + seed,
                "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "output_tok_s": 1.0,
                "total_tok_s": 10.0, "prompt_tokens": 1, "output_tokens": 1,
                "host_hit_rate": 0.5, "preemptions": 0.0, "tier_metrics": {},
                **bench.engine_step_stats({"vllm:iteration_tokens_total_count": steps,
                                           "vllm:iteration_tokens_total_sum": 10.0 * steps},
                                          10.0 + seed),
                "gpu_busy_pct": busy}

    r = bench.combine_repeats("ion", [run(0, 100.0, 90.0), run(1, 300.0, 80.0)])
    assert r["engine_steps"] == 200 and r["gpu_busy_pct"] == 85.0
    old = {"config": "native", "total_tok_s": 9.0, "ttft_p50_ms": 1.0}
    lines = bench.step_table([r, old])
    assert lines[3].startswith("| config | wall s | engine steps |")
    assert len(lines) == 6 and lines[5].startswith("| ion | 10.5 | 200 | 10.0 |")
    assert "| 85.0 |" in lines[5]
    assert bench.step_table([old]) == []
    args = SimpleNamespace(model="m", attention_backend="ION", host_gib=1.0, conversations=2,
                           turns=1, context_len=8, user_len=1, max_tokens=1, wave=1)
    md = bench.write_results(str(tmp_path), {}, [r], args, 1 << 20, 4 << 20)
    assert any(x.startswith("Engine steps") for x in md)


def test_gpu_busy_sampler_samples_while_running_and_stops():
    seen = iter(range(1000))
    with GpuBusySampler(read=lambda: float(next(seen) % 101), period_s=0.001) as s:
        end = time.monotonic() + 5.0
        while len(s.samples) < 5 and time.monotonic() < end:
            time.sleep(0.005)
    n = len(s.samples)
    assert n >= 5
    time.sleep(0.02)
    assert len(s.samples) == n  # the thread stopped with the block
    assert not any(t.name == "gpu-busy" for t in threading.enumerate())
    out = s.summary()
    assert out["gpu_busy_samples"] == n
    assert out["gpu_busy_pct"] == pytest.approx(sum(s.samples) / n)


def test_gpu_busy_without_nvml_records_nothing_and_bad_samples_are_refused():
    s = GpuBusySampler(read=None)
    s.read = None  # as on a host without NVML
    with s:
        pass
    assert s.summary() == {"gpu_busy_pct": None, "gpu_busy_p10": None, "gpu_busy_samples": 0}
    assert summarize([100.0, 0.0, 50.0])["gpu_busy_pct"] == 50.0
    assert summarize([10.0 * i for i in range(11)])["gpu_busy_p10"] == 10.0
    with pytest.raises(ValueError, match="outside 0..100"):
        summarize([101.0])


def test_each_finished_repeat_is_on_disk_at_once(tmp_path):
    cfg = {"name": "ion", "out": str(tmp_path)}
    # records as run_workload returns them (each names its config)
    bench.log_repeat(cfg, {"config": "ion", "seed": 0, "total_tok_s": 10.0})
    bench.log_repeat({**cfg, "name": "native-default"},
                     {"config": "native-default", "seed": 0, "total_tok_s": 11.0})
    import json

    rows = [json.loads(x) for x in (tmp_path / "repeats.jsonl").read_text().splitlines()]
    assert [(r["config"], r["total_tok_s"]) for r in rows] == [("ion", 10.0),
                                                              ("native-default", 11.0)]
    bench.log_repeat({"name": "x"}, {"seed": 0})  # no --out: nothing written, no error


def test_results_of_a_cut_run_are_rebuilt_from_its_finished_repeats(tmp_path):
    """``--from-repeats OUT``: a run killed by its time limit left meta.json and
    repeats.jsonl; the tables come back from them, configs in finishing order."""
    import json
    import subprocess
    import sys

    args = dict(model="m", attention_backend="ION", host_gib=1.0, conversations=2, turns=1,
                context_len=8, user_len=1, max_tokens=1, wave=1)
    (tmp_path / "meta.json").write_text(json.dumps(
        {"args": args, "hbm_kv_pool_bytes": 1 << 20, "reuse_set_bytes": 4 << 20}))

    def run(name, seed, tok_s):
        return {"config": name, "seed": seed, "requests": 1, "wall_s": 1.0,
                "ttft_p50_ms": 100.0 / tok_s, "ttft_p99_ms": 1.0, "output_tok_s": 1.0,
                "total_tok_s": tok_s, "prompt_tokens": 1, "output_tokens": 1,
                "host_hit_rate": 0.5, "preemptions": 0.0, "tier_metrics": {},
                **bench.engine_step_stats({"vllm:iteration_tokens_total_count": 10.0,
                                           "vllm:iteration_tokens_total_sum": 50.0}, 1.0)}

    rows = [run("ion", 0, 90.0), run("native-default", 0, 100.0), run("ion", 1, 110.0)]
    (tmp_path / "repeats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, bench.__file__, "--from-repeats", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["rebuilt_from_repeats"] is True
    res = {x["config"]: x for x in saved["results"]}
    assert [x["config"] for x in saved["results"]] == ["ion", "native-default"]
    assert res["ion"]["repeats"] == 2 and res["ion"]["total_tok_s"] == 100.0
    md = (tmp_path / "results.md").read_text()
    assert "| ion | 1 |" in md and "Engine steps" in md
    assert "paired by repeat: 0.900 (1 pairs)" in md  # ion r0 against native-default r0


def test_a_fresh_run_writes_meta_and_drops_an_earlier_runs_repeats(tmp_path, monkeypatch):
    """--from-repeats reads every line of OUT/repeats.jsonl, so a new run into the same
    OUT must not inherit an earlier run's repeats; it writes the meta.json the rebuild
    needs before any config runs."""
    import json
    import sys

    from test_registration import TINY_QWEN2

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "repeats.jsonl").write_text(json.dumps({"config": "stale", "seed": 0}) + "\n")
    seen = []

    def fake_child(cfg):
        seen.append((cfg["name"], (out / "repeats.jsonl").exists(),
                     (out / "meta.json").exists()))
        return {"config": cfg["name"], "error": "child exited 1"}

    monkeypatch.setattr(bench, "run_child", fake_child)
    monkeypatch.setattr(sys, "argv", ["kv_tier_bench.py", str(model), "--configs", "ion",
                                      "--out", str(out)])
    assert bench.main() == 0
    assert seen == [("ion", False, True)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["args"]["configs"] == "ion" and meta["reuse_set_bytes"] > 0
