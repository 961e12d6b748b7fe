"""scripts/gpu_session.sh's preflight, on a CPU machine: a chain whose steps need vLLM or
CuTeDSL stops at once, with the reason in steps.txt, when they are not importable (on the
GPU host that saves a device call's start-up minutes), and the demo model is made when a
step serves it and it is missing."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_session.sh")


def _env(tmp_path, **extra):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""), HF_HUB_OFFLINE="1",
               DEMO_MODEL=str(tmp_path / "demo"), **extra)
    env.pop("MODEL", None)
    return env


def _shadow(tmp_path, module: str) -> str:
    """A PATH entry whose ``python3`` fails ``python3 -c "import <module>"`` and runs
    everything else with this interpreter (CuTeDSL puts itself first on sys.path from a
    .pth file, so a PYTHONPATH shadow cannot hide it)."""
    d = tmp_path / f"shadow-{module}"
    d.mkdir()
    shim = d / "python3"
    shim.write_text("#!/usr/bin/env bash\n"
                    f'if [ "$1" = -c ] && [ "$2" = "import {module}" ]; then exit 1; fi\n'
                    f'exec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    return str(d)


@pytest.mark.parametrize("module", ["vllm", "cutlass"])
def test_preflight_stops_the_chain_when_an_import_is_missing(tmp_path, module):
    pytest.importorskip(module)
    out = tmp_path / "o"
    env = _env(tmp_path, SESSION_STEPS="kvtier")
    env["PATH"] = _shadow(tmp_path, module) + os.pathsep + env["PATH"]
    r = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 3, r.stdout + r.stderr
    steps = (out / "steps.txt").read_text()
    assert "preflight" in steps and f"not importable: {module}" in steps, steps
    assert not (out / "kvtier.log").exists() and not (tmp_path / "demo").exists()


def test_preflight_checks_only_what_the_steps_need(tmp_path):
    """kvgpu needs vLLM only: a hidden CuTeDSL does not stop it at the preflight."""
    pytest.importorskip("vllm")
    out = tmp_path / "o"
    env = _env(tmp_path, SESSION_STEPS="kvgpu")
    env["PATH"] = _shadow(tmp_path, "cutlass") + os.pathsep + env["PATH"]
    r = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (out / "steps.txt").read_text()
    assert "preflight" not in steps and "kvgpu" in steps, steps


def test_missing_demo_model_is_made_for_the_serving_steps(tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("cutlass")
    out = tmp_path / "o"
    # no GPU here: the kvtier step itself fails, after the model step made the model
    env = _env(tmp_path, SESSION_STEPS="kvtier", KVTIER_S="60", KVTIER_CONFIGS="ion")
    r = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, env=env,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (out / "steps.txt").read_text()
    assert "model    rc=0" in steps, steps
    assert (tmp_path / "demo" / "config.json").exists()
    assert "kvtier   start" in steps


def test_deadline_cuts_step_limits_and_skips_what_cannot_fit(tmp_path):
    """SESSION_DEADLINE_S: a step's limit is cut to the time left (minus 15 s), and a step
    with under 30 s left is skipped, so the command after the chain (a tar of OUT) still
    runs inside the device call's own limit."""
    pytest.importorskip("vllm")
    pytest.importorskip("cutlass")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text("{}")  # no model step
    out = tmp_path / "o"
    env = _env(tmp_path, SESSION_STEPS="kvtier", KVTIER_S="600", KVTIER_CONFIGS="ion",
               SESSION_DEADLINE_S="100")
    r = subprocess.run(["bash", SCRIPT, str(out)], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (out / "steps.txt").read_text()
    cut = [x for x in steps.splitlines() if "cut to" in x]
    assert len(cut) == 1 and "kvtier   limit 600 s cut to" in cut[0], steps
    left = int(cut[0].split("cut to ")[1].split()[0])
    assert 60 <= left <= 85, steps  # 100 - elapsed - 15
    assert "kvtier   start" in steps
    out2 = tmp_path / "o2"
    env2 = dict(env, SESSION_DEADLINE_S="40")  # 40 - 15 < 30: nothing fits
    r = subprocess.run(["bash", SCRIPT, str(out2)], capture_output=True, text=True, env=env2,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (out2 / "steps.txt").read_text()
    assert "kvtier   skipped: SESSION_DEADLINE_S=40" in steps, steps
    assert "kvtier   start" not in steps and not (out2 / "kvtier.log").exists()


@pytest.mark.parametrize("name", ["kvtier", "kvtier2"])
def test_a_cut_kvtier_step_is_rebuilt_from_its_finished_repeats(tmp_path, name):
    """When a kvtier step (the first or the second run) does not end with rc=0 and its
    repeats.jsonl holds finished repeats, the chain writes results.md from them
    (kv_tier_bench.py --from-repeats)."""
    import json

    pytest.importorskip("vllm")
    pytest.importorskip("cutlass")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text("{}")  # the kvtier step fails at once
    kv = tmp_path / "o" / name
    kv.mkdir(parents=True)
    args = dict(model="m", attention_backend="ION", host_gib=1.0, conversations=2, turns=1,
                context_len=8, user_len=1, max_tokens=1, wave=1)
    (kv / "meta.json").write_text(json.dumps(
        {"args": args, "hbm_kv_pool_bytes": 1 << 20, "reuse_set_bytes": 4 << 20}))
    run = {"config": "ion", "seed": 0, "requests": 1, "wall_s": 1.0, "ttft_p50_ms": 5.0,
           "ttft_p99_ms": 9.0, "ttft_mean_ms": 6.0, "ttft_p50_warm_ms": None,
           "output_tok_s": 1.0, "total_tok_s": 123.0,
           "prompt_tokens": 1, "output_tokens": 1, "host_hit_rate": 0.5,
           "preemptions": 0.0, "tier_metrics": {}}
    (kv / "repeats.jsonl").write_text(json.dumps(run) + "\n")
    var = name.upper()
    env = _env(tmp_path, SESSION_STEPS=name, **{f"{var}_S": "120", f"{var}_CONFIGS": "ion"})
    r = subprocess.run(["bash", SCRIPT, str(tmp_path / "o")], capture_output=True, text=True,
                       env=env, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    steps = (tmp_path / "o" / "steps.txt").read_text()
    tag = f"{name:<8s}"
    assert f"{tag} start" in steps and f"{tag} rc=0" not in steps, steps
    assert f"{tag} rebuilt from repeats.jsonl: rc=0" in steps, steps
    # TTFT mean, then the returning turns' p50 (none with one turn)
    assert "| ion | 5.0 | 9.0 | 6.0 | - | 1 | 123 |" in (kv / "results.md").read_text()
