"""``ion-bench startup`` on the CPU: start order, the environment and command line of every
start, the CuTeDSL cache emptied before each cold start only, records and table from fake
timings, and one real measurement against the fake ``vllm serve`` (tests/fake_vllm.py)."""

import shlex
from pathlib import Path

import pytest

import fake_vllm
from ion_vllm.bench import cli, e2e, report, startup

STATE_ORDER = [("ION", "prime", 0), ("FLASH_ATTN", "prime", 0),
               ("ION", "cute-cold", 0), ("ION", "warm", 0),
               ("FLASH_ATTN", "cute-cold", 0), ("FLASH_ATTN", "warm", 0),
               ("ION", "cute-cold", 1), ("ION", "warm", 1),
               ("FLASH_ATTN", "cute-cold", 1), ("FLASH_ATTN", "warm", 1)]


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_plan_primes_then_interleaves_cold_and_warm():
    assert startup.plan_starts(("ION", "FLASH_ATTN"), 2) == STATE_ORDER


def test_every_start_gets_its_labels_caches_and_the_passed_through_args(model, tmp_path):
    tag = tmp_path / "tag"
    (tag / "cute_kernels").mkdir(parents=True)
    (tag / "cute_kernels" / "__init__.py").write_text("")
    opts = e2e.E2EOptions(model=str(model), backends=("ION", f"ION@{tag}"),
                          extra_args=("--max-model-len", "8192"))
    root = tmp_path / "cache"
    env = startup.start_env(f"ION@{tag}", opts, root)
    d = root / e2e.fs_name(f"ION@{tag}")
    assert env["VLLM_CACHE_ROOT"] == str(d / "vllm") and env["CUTE_DSL_CACHE_DIR"] == str(d / "cute")
    assert env["TRITON_CACHE_DIR"] == str(d / "triton")
    assert env["PYTHONPATH"].startswith(str(tag)) and env["PYTHONSAFEPATH"] == "1"
    assert "PYTHONPATH" not in startup.start_env("ION", opts, root)
    argv = startup.serve_argv(f"ION@{tag}", opts, 8123)
    assert argv[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert argv[argv.index("--attention-backend") + 1] == "ION"
    assert argv[-4:] == ["--load-format", "dummy", "--max-model-len", "8192"]
    given = e2e.E2EOptions(model=str(model), extra_args=("--load-format=safetensors",))
    assert "dummy" not in startup.serve_argv("ION", given, 1)


def test_fake_timings_make_records_and_the_table(model, tmp_path):
    opts = e2e.E2EOptions(model=str(model), repeats=2)
    root, seen = tmp_path / "cache", []
    times = {"prime": 200.0, "cute-cold": 90.0, "warm": 40.0}

    def measure(argv, env, log_path, port, timeout):
        cute = env["CUTE_DSL_CACHE_DIR"]
        label = argv[argv.index("--attention-backend") + 1]
        state = log_path.name.split("-r")[0].split(label + "-")[1]
        seen.append((label, state, sorted(p.name for p in (root / label / "cute").iterdir())))
        with open(f"{cute}/kernel.o", "w"):  # what a start leaves in the CuTeDSL cache
            pass
        if label == "FLASH_ATTN" and state == "warm" and len(seen) == 10:
            raise TimeoutError("vllm serve not healthy after 900s")
        return times[state] / (2 if label == "FLASH_ATTN" else 1) + len(seen) / 10

    lines = []
    recs = startup.run_startup(opts, tmp_path / "out", root, log=lines.append, measure=measure)
    assert [(b, s) for b, s, _ in seen] == [(b, s) for b, s, _ in STATE_ORDER]
    # the cache is emptied before every cold start, kept for the warm start after it
    assert [files for b, s, files in seen] == [[], [], [], ["kernel.o"], [], ["kernel.o"],
                                               [], ["kernel.o"], [], ["kernel.o"]]
    by = {(r["case"], r["backend"]): r for r in recs}
    assert by[("warm", "ION")]["median_s"] == pytest.approx(40.6)  # (40.4 + 40.8) / 2
    assert by[("warm", "FLASH_ATTN")]["median_s"] == pytest.approx(20.6)  # one start failed
    assert "TimeoutError" in by[("warm", "FLASH_ATTN")]["warning"]
    assert by[("warm", "ION")]["ratio_vs_FLASH_ATTN"] == pytest.approx(40.6 / 20.6)
    assert all(r["suite"] == "startup" and r["status"] == "ok" for r in recs)
    table = report.render_table({"records": recs})
    assert "| ION | 200.1 | 90.5 (90.3–90.7, n=2) | 40.6 (40.4–40.8, n=2) |" in table
    assert f"ION warm / FLASH_ATTN warm = {40.6 / 20.6:.2f}" in table
    assert any("FAILED" in x for x in lines)


def test_measure_start_against_a_fake_server(model, tmp_path, monkeypatch):
    """Time-to-ready is launch until /health is 200 (the fake answers 503 for 0.3 s), and
    the server's process group (the fake engine core included) is stopped after it."""
    monkeypatch.setenv("PYTHONPATH", fake_vllm.install(tmp_path))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_HEALTH_DELAY", "0.3")
    opts = e2e.E2EOptions(model=str(model))
    port = e2e.free_port()
    env = startup.start_env("ION", opts, tmp_path / "c")
    s = startup.measure_start(startup.serve_argv("ION", opts, port), env,
                              tmp_path / "s.log", port, timeout=30, poll_s=0.02)
    assert 0.3 < s < 10
    fake_vllm.assert_all_stopped(log, 1)
    assert fake_vllm.calls(log, "serve")[0]["env"]["CUTE_DSL_CACHE_DIR"] == env["CUTE_DSL_CACHE_DIR"]
    monkeypatch.setenv("FAKE_SERVE_FAIL", "ION")
    with pytest.raises(RuntimeError, match="exited with code 1"):
        startup.measure_start(startup.serve_argv("ION", opts, port), env, tmp_path / "f.log",
                              port, timeout=30, poll_s=0.02)


def test_cli_dry_run_passes_unknown_arguments_to_vllm_serve(model, capsys):
    assert cli.main(["startup", "--model", str(model), "--repeats", "1", "--dry-run",
                     "--max-model-len", "8192", "--enforce-eager"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[1:3] for x in lines if x.startswith("#")] == [
        ["ION", "prime"], ["FLASH_ATTN", "prime"], ["ION", "cute-cold"], ["ION", "warm"],
        ["FLASH_ATTN", "cute-cold"], ["FLASH_ATTN", "warm"]]
    cmd = shlex.split(lines[1])
    assert cmd[0].startswith("CUTE_DSL_CACHE_DIR=") and cmd[-3:] == ["--max-model-len", "8192",
                                                                      "--enforce-eager"]
    assert cli.main(["startup", "--model", str(model), "--backends", "ION@/nowhere"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["kernel", "--enforce-eager"])  # only startup passes arguments through


def test_cold_all_runs_fresh_starts_without_a_prime(tmp_path):
    """--cold all: per repeat a start with every cache of the label emptied, then a warm one;
    no prime start, and the warm start finds what the cold one filled."""
    assert startup.plan_starts(("ION", "FLASH_ATTN"), 1, "all") == [
        ("ION", "cold", 0), ("ION", "warm", 0), ("FLASH_ATTN", "cold", 0),
        ("FLASH_ATTN", "warm", 0)]
    root = tmp_path / "caches"
    seen = []

    def measure(argv, env, log_path, port, timeout):
        label = "ION" if "ION" in " ".join(argv) else "FLASH_ATTN"
        seen.append(sorted(p.name for p in (root / label).iterdir()))
        for name in ("VLLM_CACHE_ROOT", "ION_KERNEL_CACHE"):
            (Path(env[name]) / "filled").parent.mkdir(parents=True, exist_ok=True)
            (Path(env[name]) / "filled").write_text("x")
        return 1.0

    opts = e2e.E2EOptions(backends=("ION", "FLASH_ATTN"), repeats=1, model=str(tmp_path))
    (root / "ION" / "vllm").mkdir(parents=True)
    (root / "ION" / "vllm" / "stale").write_text("x")
    recs = startup.run_startup(opts, tmp_path / "out", root, log=lambda *_: None,
                               measure=measure, cold="all")
    assert {(r["case"], r["backend"]) for r in recs} == {
        ("cold", "ION"), ("warm", "ION"), ("cold", "FLASH_ATTN"), ("warm", "FLASH_ATTN")}
    assert not (root / "ION" / "vllm" / "stale").exists(), "the cold start kept an old cache"
    with pytest.raises(ValueError):
        startup.plan_starts(("ION",), 1, "some")
