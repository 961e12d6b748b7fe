"""``ion-bench e2e`` on the CPU: the vLLM command lines (checked by vLLM 0.26's own
parsers), ``NAME@DIR`` labels, and the throughput / serve / colocated drivers against a fake
``vllm`` package (tests/fake_vllm.py): A/B/A/B order, records and ratios, failures, the
time budget, and that no server process survives."""

import json
import os
import signal
import shlex

import pytest

import fake_vllm
from ion_vllm.bench import cli, e2e, report

W = e2e.WORKLOADS
GIB = 1 << 30
BACKENDS3 = ("ION", "ION@{tag}", "FLASH_ATTN")


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


@pytest.fixture
def model(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def tag(tmp_path):
    """Another checkout: a dir with its own ion_vllm package."""
    d = tmp_path / "tag"
    (d / "ion_vllm").mkdir(parents=True)
    (d / "ion_vllm" / "__init__.py").write_text("")
    return d


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The fake vllm on PYTHONPATH, a call log, fast health polls, no GPU-name probe."""
    monkeypatch.setenv("PYTHONPATH", fake_vllm.install(tmp_path))
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    for k in ("FAKE_FAIL", "FAKE_SERVE_FAIL", "FAKE_SERVE_HANG", "FAKE_BENCH_FAIL",
              "FAKE_HEALTH_DELAY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(e2e, "HEALTH_POLL_S", 0.05)
    monkeypatch.setattr(cli, "gpu_name_via_subprocess", lambda python: "Fake GPU")
    return log


def _opts(model, **kw):
    return e2e.E2EOptions(model=str(model), **kw)


# --------------------------------------------------------------------------- commands

def test_labels_and_their_environment(tag, tmp_path):
    assert e2e.resolve_backend("FLASH_ATTN") == ("FLASH_ATTN", None)
    assert e2e.resolve_backend(f"ION@{tag}") == ("ION", str(tag))
    opts = _opts(tmp_path, env={"X": "1"})
    assert e2e.backend_env("ION", opts) == {"X": "1"}
    env = e2e.backend_env(f"ION@{tag}", opts, base={"PYTHONPATH": "/a"})
    assert env == {"X": "1", "PYTHONPATH": f"{tag}{os.pathsep}/a", "PYTHONSAFEPATH": "1"}
    assert e2e.fs_name(f"ION@{tag}") == "ION@" + str(tag).replace("/", "_")
    e2e.check_labels(["ION", f"ION@{tag}", "FLASH_ATTN"])
    for bad in (["ION", "ION"], [f"ION@{tmp_path / 'nowhere'}"], ["@x"], []):
        with pytest.raises(ValueError):
            e2e.check_labels(bad)


@pytest.mark.parametrize("name,max_len", [("seed", 8192), ("decode-heavy", 4096),
                                          ("long", 31744), ("skewed", 8960),
                                          ("shared-prefix", 7168)])
def test_colocated_server_sizing(model, name, max_len):
    """0.90 of the GPU split between the servers, a fixed KV cache, and a max-model-len that
    holds the longest prompt + output of the workload, rounded up to 256."""
    opts = _opts(model, kv_cache_gib=24.5)
    cmd = e2e.serve_cmd("FLASH_ATTN", [W[name]], opts, 8001, colocated=3)
    assert _flag(cmd, "--gpu-memory-utilization") == "0.30"
    assert _flag(cmd, "--kv-cache-memory-bytes") == str(int(24.5 * GIB))
    assert _flag(cmd, "--max-model-len") == str(max_len)
    assert _flag(cmd, "--max-num-seqs") == str(W[name].concurrency)
    assert ("--enable-prefix-caching" in cmd) == (name == "shared-prefix")
    assert _flag(cmd, "--load-format") == "dummy"  # the model dir holds no weights
    plain = e2e.serve_cmd("ION", [W[name]], _opts(model, max_model_len=12345), 1)
    assert "--gpu-memory-utilization" not in plain and _flag(plain, "--max-model-len") == "12345"


def test_dry_runs_print_interleaved_commands(model, tag, tmp_path, capsys):
    labels = ",".join(BACKENDS3).format(tag=tag)
    assert cli.main(["e2e", "--workload", "seed,skewed", "--model", str(model), "--backends",
                     labels, "--dry-run", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [shlex.split(x) for x in lines if not x.startswith("#")]
    assert [_flag(c, "--attention-backend") for c in cmds] == ["ION", "ION", "FLASH_ATTN"] * 4
    strip = [[x for x in c[:c.index("--output-json")] if x not in ("ION", "FLASH_ATTN")]
             for c in cmds[:3]]
    assert strip[0] == strip[1] == strip[2]  # the sides differ in backend and imports only
    assert sum(f"PYTHONPATH={tag}" in x for x in lines) == 4
    assert cli.main(["e2e", "--colocate", "--workload", "decode-heavy,skewed", "--repeats", "2",
                     "--model", str(model), "--kv-cache-gib", "20", "--dry-run"]) == 0
    cmds = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if x[0] != "#"]
    assert [c[3] for c in cmds[:2]] == ["serve", "serve"] and len(cmds) == 2 + 2 * 2 * 2
    assert [_flag(c, "--seed") for c in cmds[2:]] == ["0", "0", "1", "1"] * 2
    assert not (tmp_path / "o").exists()


def test_vllm_parsers_accept_every_command(model, tmp_path, cpu_platform):
    """Every planned command parses with vLLM 0.26's own parsers (bench throughput also
    passes its validate_args) to the intended values; a flag vLLM lacks is caught."""
    from vllm.benchmarks import serve as bench_serve
    from vllm.benchmarks import throughput
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def parse(cmd):
        sub = cmd[cmd.index("vllm.entrypoints.cli.main") + 1:]
        p = FlexibleArgumentParser()
        if sub[0] == "serve":
            return make_arg_parser(p).parse_args(sub[1:])
        (throughput if sub[1] == "throughput" else bench_serve).add_cli_args(p)
        a = p.parse_args(sub[2:])
        if sub[1] == "throughput":
            throughput.validate_args(a)
        return a

    opts = _opts(model, disable_detokenize=True, max_model_len=32768,
                 extra_args=("--gpu-memory-utilization", "0.85"))
    for w in W.values():
        a = parse(e2e.throughput_cmd(w, "ION", opts, tmp_path / "r.json"))
        assert (a.attention_backend, a.max_num_seqs, a.num_prompts, a.dataset_name) == \
            ("ION", w.concurrency, w.num_prompts, w.dataset)
        assert (a.load_format, a.max_model_len, a.gpu_memory_utilization) == ("dummy", 32768, 0.85)
        assert a.enable_prefix_caching is (True if w.prefix_len else None)
        a = parse(e2e.bench_serve_cmd(w, opts, 8123, tmp_path / "r.json", seed=5))
        assert (a.max_concurrency, a.seed, a.ignore_eos, a.result_filename) == \
            (w.concurrency, 5, True, "r.json")
    a = parse(e2e.serve_cmd("FLASH_ATTN", list(W.values()), _opts(model, kv_cache_gib=24), 8124, 3))
    assert (a.port, a.kv_cache_memory_bytes, a.max_model_len, a.max_num_seqs) == \
        (8124, 24 * GIB, 31744, 64)
    with pytest.raises(SystemExit):
        parse(e2e.serve_cmd("ION", [W["seed"]], opts, 1) + ["--kv-cache-gib", "3"])


def test_colocated_memory_check(model, tmp_path, monkeypatch, capsys):
    """Three 7B servers with 30 GiB of KV each overcommit an H200 (143,771 MiB): refused
    with the size that fits, before anything runs."""
    qwen7b = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
              "vocab_size": 152064, "num_attention_heads": 28, "num_key_value_heads": 4}
    (model / "config.json").write_text(json.dumps(qwen7b))
    assert e2e.estimate_weight_bytes(model) == 2 * 7_615_283_200
    h200 = 143771 << 20
    e2e.check_colocated_memory(2, 30, 2 * 7_615_283_200, h200)
    e2e.check_colocated_memory(3, 30, None, h200)
    monkeypatch.setattr(e2e, "gpu_total_bytes", lambda: h200)
    assert cli.main(["e2e", "--colocate", "--backends", "ION,FLASH_ATTN,TRITON_ATTN",
                     "--kv-cache-gib", "30", "--model", str(model), "--out", str(tmp_path / "x")]) == 2
    assert "--kv-cache-gib 29.6" in capsys.readouterr().out
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- fake vLLM

def test_throughput_ab_with_another_checkout(model, tag, tmp_path, fake):
    out = tmp_path / "res"
    labels = [b.format(tag=tag) for b in BACKENDS3]
    argv = ["e2e", "--workload", "seed", "--model", str(model), "--out", str(out),
            "--backends", ",".join(labels)]
    assert cli.main(argv) == 0
    calls = fake_vllm.calls(fake, "throughput")
    assert [c["label"] for c in calls] == ["ION", "ION@tag", "FLASH_ATTN"] * 2
    assert all(c["ion"].startswith(str(tag)) == (c["label"] == "ION@tag") for c in calls)
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert [r["total_tok_s"] for r in recs[labels[1]]["runs"]] == [1052.0, 1055.0]
    assert recs["ION"]["total_tok_s"] == 1102.5 and recs["ION"]["repeats"] == 2
    assert recs[labels[1]]["ratio_total_tok_s_vs_FLASH_ATTN"]["ratio"] == pytest.approx(1053.5 / 1004.5)
    assert "ratio_total_tok_s_vs_FLASH_ATTN" not in recs["FLASH_ATTN"]
    assert (out / "raw" / f"seed-{e2e.fs_name(labels[1])}-r1.json").exists()
    assert f"{labels[1]}/FA total" in (out / "table.md").read_text()
    assert (out / "plot.png").exists()
    assert (out / "commands.txt").read_text().split(" ", 1)[1] == \
        "ion-bench " + " ".join(argv) + "\n"
    # --accumulate continues the repeats (without it the records are replaced)
    assert cli.main(argv + ["--repeats", "1", "--accumulate"]) == 0
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert [r["repeat"] for r in recs["ION"]["runs"]] == [0, 1, 2]


def test_failed_run_is_recorded_and_its_partner_kept_out_of_the_means(model, tmp_path, fake,
                                                                      monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "FLASH_ATTN")
    out = tmp_path / "res"
    assert cli.main(["e2e", "--workload", "decode-heavy", "--repeats", "1", "--model",
                     str(model), "--out", str(out)]) == 1
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert recs["FLASH_ATTN"]["status"] == "error" and "rc=3" in recs["FLASH_ATTN"]["error"]
    assert recs["ION"]["status"] == "ok" and "ratio_total_tok_s_vs_FLASH_ATTN" not in recs["ION"]
    assert "Not measured" in (out / "table.md").read_text()


@pytest.mark.parametrize("colocate", [True, False])
def test_serve_modes(model, tag, tmp_path, fake, colocate):
    """Colocated: one server per label for both workloads, all up before any bench run;
    otherwise one server per (workload, label).  Every bench run follows a prefix-cache
    reset of its server; repeat r runs with seed 10 + r on every side; all stopped."""
    labels = tuple(b.format(tag=tag) for b in BACKENDS3)
    opts = _opts(model, backends=labels, seed=10, repeats=1 if colocate else 2)
    workloads = [W["seed"], W["skewed"]][:2 if colocate else 1]
    recs = e2e.run_serve(workloads, opts, tmp_path / "o", colocate=colocate, log=lambda s: None)
    fake_vllm.assert_all_stopped(fake, 3)
    servers = fake_vllm.calls(fake, "serve")
    assert all(s["dev"] == "1" for s in servers)
    assert [s["ion"].startswith(str(tag)) for s in servers] == \
        [lb == "ION@tag" for lb in [s["label"] for s in servers]]
    runs = [(c["label"], c["seed"]) for c in fake_vllm.calls(fake) if c["kind"] == "bench"]
    short = ["ION", "ION@tag", "FLASH_ATTN"]
    if colocate:
        assert runs == [(b, 10) for _ in range(2) for b in short]
        assert all(_flag(s["argv"], "--gpu-memory-utilization") == "0.30" for s in servers)
    else:
        assert runs == [(b, s) for b in short for s in (10, 11)]
    resets = [c["kind"] for c in fake_vllm.calls(fake) if c["kind"] in ("reset", "bench")]
    assert resets == ["reset", "bench"] * len(runs)
    by = {(r["case"], r["backend"]): r for r in recs}
    ion = by[("seed-serve", "ION")]
    assert ion["status"] == "ok" and [r["seed"] for r in ion["runs"]] == [10, 11][:opts.repeats]
    assert ion["server"]["colocated"] is colocate and ion["server"]["startup_s"] > 0
    assert ion["ttft_p50_ms"] == pytest.approx(20.5 if opts.repeats == 2 else 20.0)
    assert by[("seed-serve", labels[1])]["ratio_total_tok_s_vs_FLASH_ATTN"]["pairs"] == opts.repeats


def test_server_failures_are_recorded_and_the_rest_runs(model, tmp_path, fake, monkeypatch):
    monkeypatch.setenv("FAKE_SERVE_FAIL", "FLASH_ATTN")
    monkeypatch.setenv("FAKE_SERVE_HANG", "ION")
    monkeypatch.setenv("FAKE_BENCH_FAIL", "TRITON_ATTN")
    opts = _opts(model, backends=("ION", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"),
                 repeats=1, server_timeout=1.0)
    recs = {r["backend"]: r for r in e2e.run_serve([W["seed"]], opts, tmp_path / "o",
                                                   colocate=True, log=lambda s: None)}
    fake_vllm.assert_all_stopped(fake, 4)
    assert "TimeoutError" in recs["ION"]["error"]
    assert "exited with code 1" in recs["FLASH_ATTN"]["error"]
    assert "rc=3" in recs["TRITON_ATTN"]["error"]
    assert recs["FLASHINFER"]["status"] == "ok"
    assert [c["label"] for c in fake_vllm.calls(fake, "bench")] == ["TRITON_ATTN", "FLASHINFER"]


def test_interrupt_stops_every_server(model, tmp_path, fake, monkeypatch):
    real, n = e2e.run_logged, []

    def interrupted(*a, **k):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(e2e, "run_logged", interrupted)
    flushed = []
    with pytest.raises(KeyboardInterrupt):
        e2e.run_serve([W["seed"]], _opts(model), tmp_path / "o", colocate=True,
                      log=lambda s: None, on_records=flushed.append)
    fake_vllm.assert_all_stopped(fake, 2)
    assert flushed and flushed[0][0]["runs"]  # the finished run was flushed


def test_time_budget_skips_runs_and_keeps_pairs(model, tmp_path, fake, monkeypatch):
    """Each bench run takes 100 s on a fake clock; budget 250 s: three runs start (at 0, 100,
    200), the rest are skipped; the cut repeat's ION run stays out of the means; the CLI
    exits 0 when runs were only skipped."""
    now = [0.0]
    real = e2e.run_logged

    def slow(*a, **k):
        r = real(*a, **k)
        now[0] += 100.0
        return r
    monkeypatch.setattr(e2e, "run_logged", slow)
    opts = _opts(model, time_budget=250.0)
    recs = e2e.run_serve([W["seed"], W["skewed"]], opts, tmp_path / "o", colocate=True,
                         log=lambda s: None, t_start=0.0, clock=lambda: now[0])
    fake_vllm.assert_all_stopped(fake, 2)
    by = {(r["case"], r["backend"]): r for r in recs}
    ion, fa = by[("seed-serve", "ION")], by[("seed-serve", "FLASH_ATTN")]
    assert [r["repeat"] for r in ion["runs"]] == [0] and ion["total_tok_s"] == 1101.0
    assert [r["repeat"] for r in ion["unpaired_runs"]] == [1] and "kept out" in ion["warning"]
    assert "repeat(s) [1] not run" in fa["warning"]
    assert ion["ratio_total_tok_s_vs_FLASH_ATTN"]["pairs"] == 1
    assert [by[("skewed-serve", b)]["status"] for b in ("ION", "FLASH_ATTN")] == ["skipped"] * 2
    real_serve, now[0] = e2e.run_serve, 0.0
    monkeypatch.setattr(e2e, "run_serve", lambda *a, **k: real_serve(
        *a, **{**k, "t_start": 0.0, "clock": lambda: now[0]}))
    assert cli.main(["e2e", "--colocate", "--workload", "seed,skewed", "--time-budget", "150",
                     "--model", str(model), "--out", str(tmp_path / "c")]) == 0
    assert [r["status"] for r in report.load_summary(tmp_path / "c")["records"]] == \
        ["ok", "ok", "skipped", "skipped"]


def test_kill_group_escalates_until_the_whole_group_is_gone():
    """A server that ignores SIGINT, with a child that ignores SIGTERM too: both are gone
    after kill_group (SIGINT, then SIGTERM, then SIGKILL)."""
    import subprocess
    import sys
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN);"
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); "
            "time.sleep(60)']); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "1\n"  # the child runs and has set its handlers
    e2e.kill_group(proc, grace=0.2)
    assert proc.poll() is not None and not e2e._group_pids(proc.pid)


def test_kill_group_skips_the_sigint_grace_when_the_group_ignores_sigint():
    """Servers started from a background job inherit SIGINT ignored, and so does the
    engine core a dead server leaves behind: the group gets SIGTERM at once, not after the
    SIGINT grace."""
    import subprocess
    import sys
    import time
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN);"
            "subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); "
            "time.sleep(60)']); time.sleep({})")
    for leader_s in (60, 0):  # a live server, and one that died leaving its child
        proc = subprocess.Popen([sys.executable, "-c", code.format(leader_s)],
                                start_new_session=True, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "1\n"  # the child runs
        pids = e2e._group_pids(proc.pid)
        assert pids and all(e2e._ignores(p, signal.SIGINT) for p in pids)
        assert not e2e._ignores(pids[0], signal.SIGTERM)
        t0 = time.monotonic()
        e2e.kill_group(proc, grace=30.0)
        assert time.monotonic() - t0 < 10.0 and not e2e._group_pids(proc.pid)
