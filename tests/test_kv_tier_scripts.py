"""CPU checks of the KV tier GPU scripts' host-side logic (metrics, workload, sizing)."""

import json
import os
import subprocess
import sys

import pytest

from script_loader import load_script

from ion_vllm.kv_tier.stats import prometheus_sums

bench = load_script("kv_tier_bench.py", "kv_tier_bench_script")
preempt = load_script("kv_tier_preempt_check.py", "kv_tier_preempt_script")


def test_prometheus_sums_keeps_fractional_seconds():
    """GB/s = bytes / seconds: the time counters must not be truncated to int (vLLM's
    LLM.get_metrics does that, which read 0 s on the GPU run)."""
    from prometheus_client import Counter, Gauge

    c = Counter("vllm:ion_test_store_time", "seconds", ["engine"])
    c.labels("0").inc(0.25)
    c.labels("1").inc(0.5)
    g = Gauge("vllm:ion_test_ring_used", "slots")
    g.set(3)
    m = prometheus_sums()
    assert m["vllm:ion_test_store_time"] == pytest.approx(0.75)
    assert m["vllm:ion_test_ring_used"] == 3.0
    assert not any(k.endswith("_created") for k in m)


def test_pct_and_weights_detection(tmp_path):
    assert bench.pct([5.0, 1.0, 3.0], 50) == 3.0
    assert bench.pct([float(i) for i in range(101)], 99) == 99.0
    assert bench.pct([], 50) != bench.pct([], 50)  # nan
    (tmp_path / "config.json").write_text("{}")
    assert not bench.has_weights(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert bench.has_weights(str(tmp_path))


def test_preempt_prompts_share_prefixes():
    p = preempt.make_prompts(12, 1000, prefix_len=40, suffix_len=8, n_prefixes=3, seed=1)
    assert len(p) == 12 and all(len(x) == 48 for x in p)
    assert p[0][:40] == p[3][:40] == p[6][:40] and p[0][:40] != p[1][:40]
    assert p[0][40:] != p[3][40:]
    assert all(10 <= t < 1000 for x in p for t in x)
    assert preempt.make_prompts(12, 1000, 40, 8, 3, seed=1) == p  # deterministic


class _FakePopen:
    """Stands in for a child process: records its config and env, writes its output."""
    seen: list = []

    def __init__(self, cmd, env):
        with open(cmd[-2]) as f:
            cfg = json.load(f)
        type(self).seen.append((cfg, env))
        with open(cmd[-1], "w") as f:
            json.dump({"outputs": [[cfg.get("tag", 0)]], "metrics": {}}, f)

    def wait(self):
        return 0


def test_preempt_child_env_is_batch_invariant(monkeypatch):
    """The two runs are compared token for token, so each child must run with
    VLLM_BATCH_INVARIANT=1 unless --no-batch-invariant is given."""
    _FakePopen.seen = []
    monkeypatch.setattr(preempt.subprocess, "Popen", _FakePopen)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    preempt.run_child({"model": "m"})
    preempt.run_child({"model": "m", "batch_invariant": False})
    assert [env.get("VLLM_BATCH_INVARIANT") for _, env in _FakePopen.seen] == ["1", None]
    # a lone child plans for the default share of GPU memory
    assert all("gpu_memory_utilization" not in cfg for cfg, _ in _FakePopen.seen)


def test_preempt_parallel_children_share_the_gpu_and_keep_their_order(monkeypatch):
    _FakePopen.seen = []
    monkeypatch.setattr(preempt.subprocess, "Popen", _FakePopen)
    res = preempt.run_children([{"model": "m", "tag": k} for k in range(3)])
    assert [r["outputs"] for r in res] == [[[0]], [[1]], [[2]]]
    assert [cfg["gpu_memory_utilization"] for cfg, _ in _FakePopen.seen] == [0.3] * 3
    roots = [env["VLLM_CACHE_ROOT"] for _, env in _FakePopen.seen]
    assert len(set(roots)) == 3  # concurrent engines never share a compile cache


def test_preempt_parallel_child_failure_raises(monkeypatch):
    class Failing(_FakePopen):
        def wait(self):
            return 1

    monkeypatch.setattr(preempt.subprocess, "Popen", Failing)
    with pytest.raises(subprocess.CalledProcessError):
        preempt.run_children([{"model": "m"}, {"model": "m"}])


def test_scripts_show_help():
    for name in ("kv_tier_bench.py", "kv_tier_preempt_check.py"):
        path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", name)
        r = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True,
                           check=False, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr


def test_preempt_offload_config_selects_spec():
    ion = preempt.offload_config({"host_gib": 0.5, "ring_mib": 16})
    ext = ion["kv_connector_extra_config"]
    assert ion["kv_connector"] == "OffloadingConnector"
    assert ext["spec_name"] == "IonKVTierSpec" and ext["cpu_bytes_to_use"] == 1 << 29
    nat = preempt.offload_config({"host_gib": 0.5, "ring_mib": 16, "spec": "native"})
    ext = nat["kv_connector_extra_config"]
    assert "spec_name" not in ext and ext["offload_prompt_only"] is False
    assert ext["cpu_bytes_to_use"] == 1 << 29


def test_kv_tier_bench_configs_select_the_spec_and_its_variants():
    hb = 1 << 30
    ext = lambda n: bench.offload_transfer_config(n, hb, 256)["kv_connector_extra_config"]  # noqa: E731
    assert bench.offload_transfer_config("none", hb, 256) is None
    assert "spec_name" not in ext("native") and ext("native")["offload_prompt_only"] is False
    base = {"spec_name": "IonKVTierSpec", "spec_module_path": "ion_vllm.kv_tier.spec",
            "cpu_bytes_to_use": hb, "ring_mib": 256}
    assert ext("ion") == base  # the spec's own defaults
    assert ext("ion-defer") == {**base, "ring_overflow": "defer"}
    assert ext("ion-host") == {**base, "store_completion": "host"}
    assert ext("ion-noring") == {**base, "ring_mib": 0}
    assert ext("ion-tensor") == {**base, "host_layout": "tensor"}
    assert ext("ion-cegather") == {**base, "ring_gather": "copier"}
    assert ext("ion-chunkdrain") == {**base, "drain_chunk_kib": 128}
    assert ext("ion-gather-normal") == {**base, "gather_stream": "own",
                                        "gather_priority": "normal"}
    assert ext("ion-sidestreams") == {**base, "gather_stream": "own", "load_copy": "auto"}
    assert ext("ion-ringsmall") == {**base, "ring_max_job_blocks": 4}
    from ion_vllm.bench.offload_configs import offload_transfer_config
    with pytest.raises(ValueError, match="tier"):
        offload_transfer_config("bogus", hb)
    # every variant is a configuration the spec accepts
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from test_kv_tier_spec import _cfg as spec_config
    for name in bench.ION_CONFIGS:
        IonKVTierSpec(spec_config(ext(name), block_bytes=1 << 20))
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "kv_tier_bench.py")
    r = subprocess.run([sys.executable, path, "/m", "--configs", "ion,bogus"],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2 and "unknown config" in r.stderr


def test_preempt_fp32_children_run_without_tf32(monkeypatch):
    _FakePopen.seen = []
    monkeypatch.setattr(preempt.subprocess, "Popen", _FakePopen)
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    preempt.run_child({"model": "m", "dtype": "float32"})
    preempt.run_child({"model": "m", "dtype": "auto"})
    (_, fp32), (_, auto) = _FakePopen.seen
    assert fp32["TRITON_F32_DEFAULT"] == "ieee" and fp32["NVIDIA_TF32_OVERRIDE"] == "0"
    assert "TRITON_F32_DEFAULT" not in auto


SCHED_COST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "kv_tier_sched_cost.py")


def _sched_cost(tmp_path, *args):
    """Run scripts/kv_tier_sched_cost.py with ``args`` (offline); assert it succeeded and
    return (the completed process, the runs it wrote)."""
    out = tmp_path / "runs.json"
    r = subprocess.run([sys.executable, SCHED_COST, *args, "--out", str(out)],
                       capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return r, json.loads(out.read_text())


def test_sched_cost_script_times_both_policies(tmp_path):
    """scripts/kv_tier_sched_cost.py drives vLLM's scheduler with the Ion manager under
    both policies: eager stores decode blocks (many more store jobs than prompt-only),
    and every timing it reports is positive."""
    r, runs = _sched_cost(tmp_path, "--requests", "4", "--prompt", "64", "--gen", "80",
                          "--repeats", "1")
    eager, prompt_only = runs
    assert (eager["prompt_only"], prompt_only["prompt_only"]) == (False, True)
    # 4 requests x 80 generated tokens = 20 decode blocks of 16 tokens stored only eagerly
    assert eager["store_jobs"] >= prompt_only["store_jobs"] + 16
    for run in runs:
        assert run["steps"] >= 80 and run["schedule_us"] > 0 and run["update_us"] > 0
        assert run["manager_us_per_step"]["prepare_store"] > 0
    assert "eager" in r.stdout and "prompt-only" in r.stdout


def test_sched_cost_script_times_vllms_own_manager(tmp_path):
    """``--configs eager,native-default`` runs vLLM's own CPUOffloadingSpec manager through
    the same harness: it stores prompt blocks only, and its methods are timed as Ion's."""
    _, (eager, native) = _sched_cost(tmp_path, "--requests", "4", "--prompt", "64", "--gen",
                                     "80", "--repeats", "1", "--configs", "eager,native-default")
    assert (eager["config"], native["config"]) == ("eager", "native-default")
    assert eager["manager"] == "IonKVTierSchedulerManager"
    assert native["manager"] == "CPUOffloadingManager"
    assert native["prompt_only"] and not eager["prompt_only"]
    # 4 prompts of 64 tokens = 4 blocks each; the 80 answer tokens' 5 blocks only eagerly
    assert native["store_jobs"] <= 8 and eager["store_jobs"] >= native["store_jobs"] + 16
    assert native["manager_us_per_step"]["get_stats"] > 0
    bad = subprocess.run([sys.executable, SCHED_COST, "--configs", "eager,nope"],
                         capture_output=True, text=True, timeout=600, check=False,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_sched_cost_script_counts_preemptions_and_flushes(tmp_path):
    """With a GPU pool for 2 of 4 requests vLLM preempts; with stores that take 4 steps a
    preempted request still has store jobs in flight, which vLLM flushes (the worker's
    host wait); the script counts both, and prompt-only storing has no more jobs to
    flush than eager storing."""
    r, (eager, prompt_only) = _sched_cost(tmp_path, "--requests", "4", "--prompt", "64",
                                          "--gen", "200", "--repeats", "1",
                                          "--pool-requests", "2", "--store-lag", "4")
    assert eager["preemptions"] > 0 and prompt_only["preemptions"] > 0
    assert eager["flushed_jobs"] > 0 and eager["flush_steps"] > 0
    assert eager["flushed_jobs"] >= prompt_only["flushed_jobs"]
    for run in (eager, prompt_only):
        assert 0 <= run["flushed_in_own_step"] <= run["flushed_jobs"]
    assert "flushed jobs" in r.stdout


def test_kv_tier_pick_chooses_only_a_candidate_near_the_control(tmp_path):
    """The chain's turn-1 -> 3-turn hand-off: the fastest candidate wins only when its
    mean is within the margin of the control's; a missing control is an error (exit 2),
    not a silent "no winner"."""
    pick = load_script("kv_tier_pick.py", "kv_tier_pick_script")

    def rec(name, wall):
        return {"config": name, "wall_s": wall}

    recs = [rec("ion-noring", 36.30), rec("ion-noring", 36.40),
            rec("ion-hostids", 36.80), rec("ion-hostids", 36.90),
            rec("ion-gather-drain", 36.40), rec("ion-gather-drain", 36.50)]
    cands = ["ion-hostids", "ion-gather-drain"]
    assert pick.mean_walls(recs)["ion-noring"] == pytest.approx(36.35)
    assert pick.pick(recs, "ion-noring", cands, 0.2) == "ion-gather-drain"
    assert pick.pick(recs, "ion-noring", cands, 0.05) is None
    assert pick.pick(recs[:4], "ion-noring", cands, 0.2) is None  # hostids +0.5 s
    with pytest.raises(LookupError):
        pick.pick(recs[2:], "ion-noring", cands, 0.2)
    with pytest.raises(LookupError):
        pick.pick(recs[:2], "ion-noring", cands, 0.2)

    (tmp_path / "repeats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = [sys.executable, os.path.join(os.path.dirname(pick.__file__), "kv_tier_pick.py"),
            str(tmp_path), "--control", "ion-noring", "--candidates", ",".join(cands)]
    out = subprocess.run(args + ["--within", "0.2"], capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip()) == (0, "ion-gather-drain")
    out = subprocess.run(args + ["--within", "0.01"], capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip()) == (0, "")
    out = subprocess.run(args[:-4] + ["--control", "native", "--candidates", "ion",
                                      "--within", "1"], capture_output=True, text=True)
    assert out.returncode == 2 and "control" in out.stderr
