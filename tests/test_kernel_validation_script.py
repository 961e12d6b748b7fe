"""scripts/kernel_validation.sh on a machine without a GPU: every step fails cleanly (no
CUDA), the script still finishes, records each step's exit code and writes its summary and
bundle.  (On the H200 the same command is the one-call kernel validation.)"""

import os
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
@pytest.mark.parametrize("parallel", ["0", "1"])
def test_script_completes_and_summarizes_without_gpu(tmp_path, parallel):
    out = tmp_path / "kv"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""), HF_HUB_OFFLINE="1", KVAL_PARALLEL=parallel,
               CUTE_DSL_CACHE_DIR=str(tmp_path / "cute-cache"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "kernel_validation.sh"),
                        str(out), "4"], capture_output=True, text=True, env=env, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = (out / "steps.txt").read_text().splitlines()
    names = [s.split()[0] for s in steps]
    assert names == ["pytest-gpu", "sweep-append", "sweep-fused", "sweep-unpacked",
                     "sweep-m128", "sweep-rowcomb", "sweep-lazy", "sweep-pdl",
                     "sweep-fused128", "sweep-lanes", "sweep-kvpair", "sweep-fusedkp",
                     "sweep-s2", "sweep-fuseds2", "sweep-pp", "sweep-fusedpp",
                     "sweep-m192", "sweep-fused192", "sweep-fusedlanes", "sweep-pin", "sweep-fusedpin", "bench-anchors"]
    # without a GPU nothing can pass: no step may claim success
    assert all("rc=0 " not in s for s in steps), steps
    summary = (out / "summary.md").read_text()
    assert "sweep-fused: no summary" in summary
    with tarfile.open(str(out) + ".tgz") as t:
        assert any(n.endswith("summary.md") for n in t.getnames())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_step_subset(tmp_path):
    """KVAL_STEPS runs only the named steps; the others are listed as not run ("-")."""
    out = tmp_path / "kv"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""), HF_HUB_OFFLINE="1", KVAL_PARALLEL="1",
               KVAL_STEPS="sweep-fused bench-anchors", KVAL_BACKENDS="ion",
               CUTE_DSL_CACHE_DIR=str(tmp_path / "cute-cache"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "kernel_validation.sh"),
                        str(out), "2"], capture_output=True, text=True, env=env, timeout=900,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = {s.split()[0]: s.split()[1] for s in (out / "steps.txt").read_text().splitlines()}
    assert steps["pytest-gpu"] == "rc=-" and steps["sweep-append"] == "rc=-"
    assert steps["sweep-fused"] != "rc=-" and steps["bench-anchors"] != "rc=-"
    assert not (out / "sweep-append.log").exists() and (out / "sweep-fused.log").exists()
    bench_line = [ln for ln in r.stdout.splitlines() if ln.startswith("== bench-anchors")]
    assert bench_line and "--backends ion --out" in bench_line[0], r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_pytest_file_subset(tmp_path):
    """KVAL_PYTEST_FILES narrows the pytest-gpu step to the named files (no GPU here: the
    step collects them and deselects every test, so it cannot claim success)."""
    out = tmp_path / "kv"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
               + os.environ.get("PATH", ""), KVAL_STEPS="pytest-gpu",
               KVAL_PYTEST_FILES="tests/test_sass_profile.py",
               CUTE_DSL_CACHE_DIR=str(tmp_path / "cute-cache"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "kernel_validation.sh"),
                        str(out), "2"], capture_output=True, text=True, env=env, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tests/test_sass_profile.py" in r.stdout and "test_lane_combine_gpu" not in r.stdout
    log = (out / "pytest-gpu.log").read_text()
    # every test of that file is a CPU test: all deselected, none run
    assert "deselected" in log and " passed" not in log, log[-1500:]
    steps = {s.split()[0]: s.split()[1] for s in (out / "steps.txt").read_text().splitlines()}
    assert steps["pytest-gpu"] != "rc=0"


def _shard_env(tmp_path):
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                + os.environ.get("PATH", ""), CUTE_DSL_CACHE_DIR=str(tmp_path / "cute-cache"))


def test_pytest_shards_run_every_file_once_and_fail_with_any_shard(tmp_path):
    """scripts/pytest_gpu_shards.sh: N pytest processes over the files round-robin, each
    with its own CuTeDSL cache dir; the exit status is nonzero when any shard fails."""
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "conftest.py").write_text(
        "import os\n"
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'gpu: test')\n"
        "    open(os.path.join(os.path.dirname(__file__), 'cache-' +\n"
        "         os.path.basename(os.environ['CUTE_DSL_CACHE_DIR'])), 'a').close()\n")
    for i in range(3):
        (tests / f"test_f{i}.py").write_text(
            "import pytest\n@pytest.mark.gpu\ndef test_ok():\n    pass\n")
    script = os.path.join(ROOT, "scripts", "pytest_gpu_shards.sh")
    files = [str(tests / f"test_f{i}.py") for i in range(3)]
    r = subprocess.run(["bash", script, "2", str(tmp_path / "log")] + files,
                       capture_output=True, text=True, env=_shard_env(tmp_path), timeout=300,
                       check=False, cwd=str(tests))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in (tmp_path / "log.1.log").read_text()
    assert "2 passed" in (tmp_path / "log.0.log").read_text()
    assert sorted(p.name for p in tests.glob("cache-*")) == ["cache-cute-cache-shard0",
                                                              "cache-cute-cache-shard1"]
    (tests / "test_f1.py").write_text(
        "import pytest\n@pytest.mark.gpu\ndef test_bad():\n    assert False\n")
    r = subprocess.run(["bash", script, "3", str(tmp_path / "log")] + files,
                       capture_output=True, text=True, env=_shard_env(tmp_path), timeout=300,
                       check=False, cwd=str(tests))
    assert r.returncode == 1 and "shard 1 rc=1" in r.stdout, r.stdout
    r = subprocess.run(["bash", script, "0", str(tmp_path / "log")] + files,
                       capture_output=True, text=True, env=_shard_env(tmp_path), timeout=60,
                       check=False)
    assert r.returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_pytest_gpu_step_in_shards(tmp_path):
    """KVAL_PYTEST_SHARDS=2: the pytest-gpu step runs the shard script (no GPU here: every
    test is deselected, so the step cannot claim success)."""
    out = tmp_path / "kv"
    env = dict(_shard_env(tmp_path), KVAL_STEPS="pytest-gpu", KVAL_PYTEST_SHARDS="2",
               KVAL_PYTEST_FILES="tests/test_sass_profile.py tests/test_kbench_phases.py")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "kernel_validation.sh"),
                        str(out), "2"], capture_output=True, text=True, env=env, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pytest_gpu_shards.sh 2" in r.stdout
    assert "deselected" in (out / "pytest-gpu-shard.0.log").read_text()
    assert "deselected" in (out / "pytest-gpu-shard.1.log").read_text()
    steps = {s.split()[0]: s.split()[1] for s in (out / "steps.txt").read_text().splitlines()}
    assert steps["pytest-gpu"] != "rc=0"
