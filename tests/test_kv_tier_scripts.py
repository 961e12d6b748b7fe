"""CPU checks of the KV tier GPU scripts' host-side logic (metrics, workload, sizing)."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from script_loader import load_script

from ion_vllm.bench.offload_configs import prometheus_sums

bench = load_script("kv_tier_bench.py", "kv_tier_bench_script")
preempt = load_script("kv_tier_preempt_check.py", "kv_tier_preempt_script")


@pytest.fixture(autouse=True)
def _temporary_folders_under_tmp_path(tmp_path, monkeypatch):
    """The scripts' temporary folders (tempfile) go under pytest's tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


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
    assert bench.CONFIGS == ("none", "native", "native-default", "ion")
    assert bench.offload_transfer_config("none", hb, 256) is None
    assert "spec_name" not in ext("native") and ext("native")["offload_prompt_only"] is False
    assert ext("native-default") == {"cpu_bytes_to_use": hb}
    assert ext("ion") == {"spec_name": "IonKVTierSpec", "spec_module_path": "ion_vllm.kv_tier.spec",
                          "cpu_bytes_to_use": hb, "ring_mib": 256}
    from ion_vllm.bench.offload_configs import offload_transfer_config
    with pytest.raises(ValueError, match="tier"):
        offload_transfer_config("bogus", hb)
    # the Ion config is one the spec accepts
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from test_kv_tier_spec import _cfg as spec_config
    IonKVTierSpec(spec_config(ext("ion"), block_bytes=1 << 20))
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "kv_tier_bench.py")
    for bad in ("ion,bogus", "ion-defer"):  # the lab's variants are gone
        r = subprocess.run([sys.executable, path, "/m", "--configs", bad],
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
