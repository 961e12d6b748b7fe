"""scripts/gpu_session.sh on the CPU, without running any step and without copying the
checkout: the command each step would run (SESSION_DRY_RUN), the deadline's cuts, the
import preflight, and the code snapshot on a tiny fake tree (removed when the chain ends)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def _run(tmp_path, script=SCRIPT, **env):
    full = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "SESSION_SNAPSHOT": "0",
            "SESSION_DRY_RUN": "1", "MODEL": str(tmp_path / "model"),
            "TINY_MODEL": str(tmp_path / "tiny"),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **env}
    (tmp_path / "tmp").mkdir(exist_ok=True)
    r = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True,
                       text=True, env=full, timeout=120)
    steps = (tmp_path / "out" / "steps.txt").read_text()
    return r.returncode, steps


def _cmd(steps: str, name: str) -> str:
    return next(x.split("): ", 1)[1] for x in steps.splitlines()
                if x.split()[1] == name and "would run" in x)


def test_dry_run_lists_every_step_with_its_knobs(tmp_path):
    rc, steps = _run(tmp_path, SESSION_STEPS="kval kbench e2e startup agree kvgpu kvtier preempt "
                     "sanitize", SANITIZE_TOOLS="memcheck racecheck", SANITIZE_CASES="5",
                     SANITIZE_SHARD="1/3", SANITIZE_BUDGET_S="200",
                     KBENCH_SUITES="anchors engine-d64", KBENCH_REGISTER="tag.py",
                     E2E_BACKENDS="ION,ION@/x/tag,FLASH_ATTN", E2E_WORKLOADS="seed",
                     STARTUP_REPEATS="2", STARTUP_COLD="all",
                     STARTUP_ARGS="--max-model-len 8192", KVAL_CASES="7",
                     KVAL_TESTS="tests/test_kv_append.py", KVAL_SHARDS="2",
                     KVAL_SWEEP_SHARDS="2")
    assert rc == 0, steps
    names = [x.split()[1] for x in steps.splitlines() if "would run" in x]
    # test shards and sweep shards side by side, then one step each
    assert sorted(names[:4]) == ["kval-tests-00", "kval-tests-01", "sweep-0", "sweep-1"]
    assert names[4:11] == ["kbench", "startup", "e2e", "agree", "kvgpu", "kvtier", "preempt"]
    # the sanitizer runs side by side
    assert sorted(names[11:]) == ["san-memcheck-sweep", "san-memcheck-tests",
                                  "san-racecheck-sweep", "san-racecheck-tests"]
    for tool in ("memcheck", "racecheck"):
        sweep, tests = _cmd(steps, f"san-{tool}-sweep"), _cmd(steps, f"san-{tool}-tests")
        assert sweep.startswith(f"compute-sanitizer --tool {tool} --error-exitcode 99")
        assert "--report-api-errors no --kernel-name-exclude kns=nvjet" in sweep
        assert "gpu_sweep.py --cases 5 --shard 1/3 --seed" in sweep
        assert "--max-kv-tokens 4096 --time-budget 200" in sweep
        assert f"{tmp_path / 'out' / 'sanitize' / tool}-tests.log" in tests
        assert tests.endswith("tests/test_kv_append.py tests/test_kv_tier_gpu.py")
    shards = _cmd(steps, "kval-tests-00") + " " + _cmd(steps, "kval-tests-01")
    assert "tests/test_kv_append.py::test_kv_append_matches_reference" in shards
    sweeps = [_cmd(steps, f"sweep-{i}") for i in (0, 1)]
    assert all("--cases 7 --seed" in c for c in sweeps)
    assert {c.split("--seed ")[1].split()[0] for c in sweeps} == {
        sweeps[0].split("--seed ")[1].split()[0]}, "the sweep shards share one seed"
    assert "--shard 0/2" in sweeps[0] and "--shard 1/2" in sweeps[1]
    kb = _cmd(steps, "kbench")
    assert ("cli kernel --suite anchors --suite engine-d64 --register tag.py "
            "--backends ion,ion-attn") in kb
    e2e = _cmd(steps, "e2e")
    assert "--serve --colocate --workload seed --backends ION,ION@/x/tag,FLASH_ATTN" in e2e
    assert f"--model {tmp_path / 'model'}" in e2e and "--time-budget 900" in e2e
    assert _cmd(steps, "startup").endswith(f"--repeats 2 --cold all --model {tmp_path / 'model'}"
                                           f" --out {tmp_path / 'out' / 'startup'} "
                                           "--max-model-len 8192")
    assert f"kv_tier_preempt_check.py {tmp_path / 'tiny'}" in _cmd(steps, "preempt")
    assert steps.splitlines()[-1].split()[1:] == ["all", "done"]
    assert not list((tmp_path / "tmp").iterdir())  # the scratch dir is gone


def test_kval_refuses_a_test_list_that_collects_nothing(tmp_path):
    """A bad id in KVAL_TESTS collects nothing: no shard may fall back to the whole tree."""
    rc, steps = _run(tmp_path, SESSION_STEPS="kval", KVAL_SHARDS="3", KVAL_SWEEP_SHARDS="1",
                     KVAL_TESTS="tests/test_kv_append.py::no_such_test")
    assert rc == 0, steps
    assert "kval-tests   refused: collection rc=4, 0 ids" in steps
    names = [x.split()[1] for x in steps.splitlines() if "would run" in x]
    assert names == ["sweep-0"], steps
    assert (tmp_path / "out" / "kval-collect.log").read_text()
    # and a list shorter than the shard count leaves no empty shard behind
    rc, steps = _run(tmp_path, SESSION_STEPS="kval", KVAL_SHARDS="4", KVAL_SWEEP_SHARDS="1",
                     KVAL_TESTS="tests/test_kv_append.py::test_kv_append_single_token_and_empty")
    names = [x.split()[1] for x in steps.splitlines() if "would run" in x]
    assert sorted(names) == ["kval-tests-00", "sweep-0"], steps


def test_missing_models_are_made_first(tmp_path):
    env = {"SESSION_STEPS": "e2e agree", "MODEL": "", "TINY_MODEL": ""}
    rc, steps = _run(tmp_path, **env)
    assert [x.split()[1] for x in steps.splitlines() if "would run" in x] == \
        ["model", "tiny", "e2e", "agree"]
    assert f"make_demo_model.py {ROOT / 'bench' / 'demo-model'}" in _cmd(steps, "model")


def test_models_step_covers_each_family_then_speculation(tmp_path):
    rc, steps = _run(tmp_path, SESSION_STEPS="models", MODELS_ARCHS="gemma2 mistral",
                     TINY_MODEL="")
    names = [x.split()[1] for x in steps.splitlines() if "would run" in x]
    assert names == ["tiny", "model-gemma2", "serve-gemma2", "agree-gemma2", "model-mistral",
                     "serve-mistral", "agree-mistral", "agree-spec"]
    assert "make_tiny_model.py" in _cmd(steps, "model-gemma2") \
        and _cmd(steps, "model-gemma2").endswith("--arch gemma2")
    assert _cmd(steps, "serve-mistral").startswith("bash scripts/serve_check.sh")
    assert "--spec-ngram 3" in _cmd(steps, "agree-spec")
    rc, steps = _run(tmp_path, SESSION_STEPS="models", MODELS_ARCHS="gemma3", MODELS_SPEC="0",
                     TINY_MODEL="")
    assert [x.split()[1] for x in steps.splitlines() if "would run" in x] == \
        ["model-gemma3", "serve-gemma3", "agree-gemma3"]


def test_deadline_cuts_limits_and_skips_what_cannot_fit(tmp_path):
    rc, steps = _run(tmp_path, SESSION_STEPS="startup kvgpu", SESSION_DEADLINE_S="100")
    assert "startup      limit 2400 s cut to" in steps and "kvgpu        limit 300 s cut to" in steps
    left = int(steps.split("cut to ")[1].split()[0])
    assert 60 <= left <= 85
    rc, steps = _run(tmp_path, SESSION_STEPS="startup", SESSION_DEADLINE_S="40")
    assert "startup      skipped: SESSION_DEADLINE_S=40" in steps and "would run" not in steps


@pytest.mark.parametrize("steps_env,missing", [("kbench", "cutlass"), ("kvgpu", "vllm"),
                                               ("e2e", "vllm cutlass")])
def test_preflight_stops_the_chain_when_imports_are_missing(tmp_path, steps_env, missing):
    """A python3 whose vllm / cutlass imports fail: exit 3 with the reason, nothing run."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "python3").write_text('#!/usr/bin/env bash\n[ "$1" = -c ] && [[ "$2" == import* ]]'
                                    f' && exit 1\nexec "{sys.executable}" "$@"\n')
    (shadow / "python3").chmod(0o755)
    rc, steps = _run(tmp_path, SESSION_STEPS=steps_env, SESSION_DRY_RUN="0",
                     PATH=f"{shadow}{os.pathsep}{os.environ['PATH']}")
    assert rc == 3 and f"not importable: {missing}" in steps and "start:" not in steps


def test_snapshot_copies_the_code_only_and_is_removed(tmp_path):
    tree = tmp_path / "tree"
    for d in ("scripts", "ion_vllm", "cute_kernels", "tests", ".venv", "bench/results"):
        (tree / d).mkdir(parents=True)
    shutil.copy(SCRIPT, tree / "scripts")
    (tree / "ion_vllm" / "x.py").write_text("")
    (tree / ".venv" / "big").write_text("x" * 1000)
    rc, steps = _run(tmp_path, script=tree / "scripts" / "gpu_session.sh", SESSION_STEPS="",
                     SESSION_SNAPSHOT="1")
    assert rc == 0
    snap = next(x for x in steps.splitlines() if x.split()[1] == "snapshot")
    assert snap.split()[2:] == ["cute_kernels", "ion_vllm", "scripts", "tests"]
    assert not list((tmp_path / "tmp").iterdir())
