"""``ion-bench e2e --serve --colocate`` on CPU: the colocated server commands (memory
split, fixed KV cache, sizing from the workloads, checked by vLLM 0.26's own parsers),
the A/B/A/B bench plan with per-repeat seeds, and the runner against a fake vLLM that
serves HTTP (/health, /reset_prefix_cache) and writes bench-serve JSON like vLLM's:
records, server failures, time budget, and that no server process survives."""

import json
import os
import shlex
import signal
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ion_vllm.bench import cli, e2e, report

W = e2e.WORKLOADS
GIB = 1 << 30


def _model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def _opts(tmp_path, **kw):
    kw.setdefault("model", str(_model_dir(tmp_path)))
    return e2e.E2EOptions(**kw)


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


# --------------------------------------------------------------------------- commands

def test_memory_split_and_kv_bytes(tmp_path):
    assert [e2e.colocate_gpu_memory_utilization(n) for n in (1, 2, 3, 4, 7)] == \
        [0.90, 0.45, 0.30, 0.22, 0.12]
    with pytest.raises(ValueError):
        e2e.colocate_gpu_memory_utilization(0)
    for backends, util in ((("ION", "FLASH_ATTN"), "0.45"),
                           (("ION", "ION+unpacked", "FLASH_ATTN"), "0.30")):
        opts = _opts(tmp_path / str(len(backends)), backends=backends)
        for b in backends:
            cmd = e2e.colocate_serve_cmd([W["seed"]], b, opts, 8000)
            assert _flag(cmd, "--gpu-memory-utilization") == util
            assert _flag(cmd, "--kv-cache-memory-bytes") == str(40 * GIB)
    opts = _opts(tmp_path, kv_cache_gib=24.5)
    assert _flag(e2e.colocate_serve_cmd([W["seed"]], "ION", opts, 8000),
                 "--kv-cache-memory-bytes") == str(int(24.5 * GIB))
    with pytest.raises(ValueError):
        e2e.colocate_serve_cmd([W["seed"]], "ION", _opts(tmp_path / "z", kv_cache_gib=0), 1)


def test_max_num_seqs_and_max_model_len_rule(tmp_path):
    opts = _opts(tmp_path)
    # max_prompt_len + ceil(output_len * (1 + range_ratio)), rounded up to 256
    expect = {"seed": 7680 + 512,                           # 8192 exactly
              "decode-heavy": 2048 + 2048,                  # 4096
              "long": 30720 + 1024,                         # 31744 = 124 * 256
              "skewed": 8960,                               # 7782 + 973 = 8755 -> 8960
              "shared-prefix": 7168}                        # 6144 + 512 + 512
    for name, n in expect.items():
        assert e2e.colocate_max_model_len([W[name]], opts) == n, name
        assert n % 256 == 0
    assert W["skewed"].max_prompt_len == 7782
    ws = [W["decode-heavy"], W["skewed"], W["shared-prefix"]]
    assert e2e.colocate_max_model_len(ws, opts) == 8960
    assert e2e.colocate_max_num_seqs(ws) == 64
    assert e2e.colocate_max_num_seqs([W["long"], W["shared-prefix"]]) == 32
    cmd = e2e.colocate_serve_cmd(ws, "FLASH_ATTN", opts, 8001)
    assert _flag(cmd, "--max-model-len") == "8960" and _flag(cmd, "--max-num-seqs") == "64"
    assert _flag(cmd, "--port") == "8001" and _flag(cmd, "--attention-backend") == "FLASH_ATTN"
    assert "--enable-prefix-caching" in cmd and "--no-enable-prefix-caching" not in cmd
    assert _flag(cmd, "--load-format") == "dummy"  # the model dir has no weights
    # a user-given --max-model-len wins; a workload that doesn't need prefix caching
    # leaves vLLM's default alone
    opts2 = _opts(tmp_path / "o2", max_model_len=12345, extra_args=("--enforce-eager",))
    cmd = e2e.colocate_serve_cmd([W["long"]], "ION+unpacked", opts2, 9)
    assert _flag(cmd, "--max-model-len") == "12345" and cmd[-1] == "--enforce-eager"
    assert _flag(cmd, "--attention-backend") == "ION"
    assert "--enable-prefix-caching" not in cmd


def test_server_env_per_label(tmp_path):
    opts = _opts(tmp_path, env={"FOO": "1"})
    assert e2e.colocate_server_env("ION", opts) == {"VLLM_SERVER_DEV_MODE": "1", "FOO": "1"}
    assert e2e.colocate_server_env("ION+unpacked", opts) == {
        "VLLM_SERVER_DEV_MODE": "1", "FOO": "1", "ION_UNPACKED_PREFILL": "1"}


def test_distinct_ports(monkeypatch):
    seq = iter([5000, 5000, 5001, 5000, 5002])
    monkeypatch.setattr(e2e, "free_port", lambda: next(seq))
    assert e2e.distinct_free_ports(3) == [5000, 5001, 5002]


def test_plan_interleaves_with_per_repeat_seeds(tmp_path):
    opts = _opts(tmp_path, backends=("ION", "FLASH_ATTN"), repeats=2, seed=7)
    ports = {"ION": 8100, "FLASH_ATTN": 8200}
    ws = [W["decode-heavy"], W["long"]]
    plan = e2e.plan_colocated(ws, opts, tmp_path / "o", ports)
    assert [(w.name, b, r, s) for w, b, r, s, _, _ in plan] == [
        ("decode-heavy", "ION", 0, 7), ("decode-heavy", "FLASH_ATTN", 0, 7),
        ("decode-heavy", "ION", 1, 8), ("decode-heavy", "FLASH_ATTN", 1, 8),
        ("long", "ION", 0, 7), ("long", "FLASH_ATTN", 0, 7),
        ("long", "ION", 1, 8), ("long", "FLASH_ATTN", 1, 8)]
    for w, b, r, s, cmd, path in plan:
        assert cmd[3:5] == ["bench", "serve"]
        assert _flag(cmd, "--seed") == str(s)
        assert _flag(cmd, "--base-url") == f"http://127.0.0.1:{ports[b]}"
        assert _flag(cmd, "--max-concurrency") == str(w.concurrency)
        assert path == tmp_path / "o" / "raw" / f"{w.name}-serve-{b}-r{r}.json"
        assert _flag(cmd, "--result-filename") == path.name
    # --accumulate: repeats (and seeds) continue after the kept ones
    plan = e2e.plan_colocated([W["long"]], opts, tmp_path, ports, offsets={"long": 2})
    assert [(r, s) for _, _, r, s, _, _ in plan] == [(2, 9), (2, 9), (3, 10), (3, 10)]


def test_bench_serve_cmd_takes_the_repeat_seed(tmp_path):
    opts = _opts(tmp_path, seed=3)
    assert _flag(e2e.bench_serve_cmd(W["seed"], opts, 1, "d", "f"), "--seed") == "3"
    assert _flag(e2e.bench_serve_cmd(W["seed"], opts, 1, "d", "f", seed=5), "--seed") == "5"


def test_colocated_commands_accepted_by_vllm_parsers(tmp_path):
    """Every flag the colocated mode emits exists in vLLM 0.26's `vllm serve` and
    `vllm bench serve` parsers, and parses to the intended value."""
    pytest.importorskip("vllm")
    opts = _opts(tmp_path, backends=("ION", "ION+unpacked", "FLASH_ATTN"), repeats=2,
                 kv_cache_gib=24)
    ws = e2e.select_workloads(["decode-heavy,long,skewed,shared-prefix"])
    ports = {"ION": 8100, "ION+unpacked": 8101, "FLASH_ATTN": 8102}
    serves = [e2e.colocate_serve_cmd(ws, b, opts, ports[b]) for b in opts.backends]
    plan = e2e.plan_colocated(ws, opts, tmp_path / "o", ports)
    res = e2e.check_with_vllm_parser(serves + [c for *_, c, _ in plan])
    assert [r["ok"] for r in res] == [True] * (len(serves) + len(plan)), \
        [r.get("error") for r in res]
    for b, r in zip(opts.backends, res):
        a = r["args"]
        assert a["port"] == ports[b] and a["host"] == "127.0.0.1"
        assert a["attention_backend"] == ("ION" if b.startswith("ION") else "FLASH_ATTN")
        assert a["gpu_memory_utilization"] == 0.30
        assert a["kv_cache_memory_bytes"] == 24 * GIB
        assert a["max_num_seqs"] == 64 and a["max_model_len"] == 31744
        assert a["enable_prefix_caching"] is True
        assert a["load_format"] == "dummy" and a["seed"] == 0
    for (w, b, rep, seed, _, path), r in zip(plan, res[len(serves):]):
        a = r["args"]
        assert a["seed"] == seed == rep
        assert a["base_url"] == f"http://127.0.0.1:{ports[b]}"
        assert a["max_concurrency"] == w.concurrency and a["num_prompts"] == w.num_prompts
        assert a["dataset_name"] == w.dataset
        assert a["result_filename"] == path.name
    # a flag vLLM does not have is caught (the check can fail)
    bad = e2e.colocate_serve_cmd(ws, "ION", opts, 1) + ["--kv-cache-gib", "3"]
    assert e2e.check_with_vllm_parser([bad])[0]["ok"] is False


# --------------------------------------------------------------------------- refusal

def test_refuses_workload_without_prefix_caching(tmp_path, monkeypatch, capsys):
    off = e2e.Workload("no-prefix", 1024, 128, 8, 16, prefix_caching=False)
    with pytest.raises(ValueError, match="no-prefix"):
        e2e.check_colocatable([W["seed"], off])
    opts = _opts(tmp_path)
    with pytest.raises(ValueError, match="prefix caching"):
        e2e.colocate_serve_cmd([off], "ION", opts, 1)

    def no_popen(*a, **k):
        raise AssertionError("nothing may start")
    monkeypatch.setattr(e2e.subprocess, "Popen", no_popen)
    with pytest.raises(ValueError):
        e2e.run_serve_colocated([W["seed"], off], opts, tmp_path / "o", log=lambda s: None)
    monkeypatch.setitem(e2e.WORKLOADS, off.name, off)
    m = _model_dir(tmp_path / "cli")
    for extra in (["--dry-run"], []):
        assert cli.main(["e2e", "--serve", "--colocate", "--workload", "seed,no-prefix",
                         "--model", str(m), "--out", str(tmp_path / "o2"), *extra]) == 2
        assert "no-prefix" in capsys.readouterr().out
    assert not (tmp_path / "o2").exists()
    # the same workload is fine without --colocate (one server per workload)
    assert cli.main(["e2e", "--serve", "--workload", "no-prefix", "--model", str(m),
                     "--dry-run"]) == 0
    assert "--no-enable-prefix-caching" in capsys.readouterr().out


def test_cli_option_checks(tmp_path, capsys):
    m = _model_dir(tmp_path)
    assert cli.main(["e2e", "--serve", "--time-budget", "60", "--model", str(m),
                     "--dry-run"]) == 2
    assert "--colocate" in capsys.readouterr().out
    assert cli.main(["e2e", "--colocate", "--kv-cache-gib", "0", "--model", str(m),
                     "--dry-run"]) == 2


QWEN25_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
             "vocab_size": 152064, "num_attention_heads": 28, "num_key_value_heads": 4,
             "head_dim": 128, "tie_word_embeddings": False}


def test_weight_estimate_from_config(tmp_path):
    """Qwen2.5-7B's config gives its 7,615,283,200 parameters (2 bytes each); MoE configs,
    empty and missing configs give None (no memory check)."""
    m = _model_dir(tmp_path)
    assert e2e.estimate_weight_bytes(m) is None  # "{}"
    (m / "config.json").write_text(json.dumps(QWEN25_7B))
    assert e2e.estimate_weight_bytes(m) == 2 * 7_615_283_200
    tied = dict(QWEN25_7B, tie_word_embeddings=True)
    (m / "config.json").write_text(json.dumps(tied))
    assert e2e.estimate_weight_bytes(m) == 2 * (7_615_283_200 - 152064 * 3584)
    (m / "config.json").write_text(json.dumps(dict(QWEN25_7B, num_experts=8)))
    assert e2e.estimate_weight_bytes(m) is None
    assert e2e.estimate_weight_bytes(tmp_path / "nowhere") is None


def test_colocated_memory_check():
    """Three 7B servers with 30 GiB of KV each overcommit an H200 (143,771 MiB): refused,
    with the KV size that fits; two fit; an unknown GPU or model is not checked."""
    h200, w = 143771 << 20, 2 * 7_615_283_200
    e2e.check_colocated_memory(2, 30, w, h200)
    with pytest.raises(ValueError, match=r"--kv-cache-gib 29\.6 or fewer backends"):
        e2e.check_colocated_memory(3, 30, w, h200)
    e2e.check_colocated_memory(3, 29.6, w, h200)
    with pytest.raises(ValueError, match="reserve alone do not fit"):
        e2e.check_colocated_memory(10, 1, w, h200)
    e2e.check_colocated_memory(3, 30, None, h200)
    e2e.check_colocated_memory(3, 30, w, None)


def test_cli_refuses_an_overcommitted_colocated_run(tmp_path, monkeypatch, capsys):
    m = _model_dir(tmp_path)
    (m / "config.json").write_text(json.dumps(QWEN25_7B))
    monkeypatch.setattr(e2e, "gpu_total_bytes", lambda: 143771 << 20)
    assert cli.main(["e2e", "--colocate", "--backends", "ION,ION+append,FLASH_ATTN",
                     "--kv-cache-gib", "30", "--model", str(m),
                     "--out", str(tmp_path / "res")]) == 2
    out = capsys.readouterr().out
    assert "> the GPU's 140.4 GiB" in out and "--kv-cache-gib 29.6" in out
    assert not (tmp_path / "res").exists()  # refused before anything ran


def test_log_tail(tmp_path):
    p = tmp_path / "server.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)))
    assert e2e.log_tail(p, 3) == "line 97\nline 98\nline 99"
    assert e2e.log_tail(tmp_path / "missing") == ""


def test_colocated_dry_run(tmp_path, capsys):
    m = _model_dir(tmp_path)
    assert cli.main(["e2e", "--serve", "--colocate", "--workload", "decode-heavy,skewed",
                     "--backends", "ION,ION+unpacked,FLASH_ATTN", "--repeats", "2",
                     "--model", str(m), "--kv-cache-gib", "20", "--time-budget", "540",
                     "--dry-run", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [shlex.split(x) for x in lines if not x.startswith("#")]
    serves = [c for c in cmds if c[3] == "serve"]
    benches = [c for c in cmds if c[3:5] == ["bench", "serve"]]
    assert len(serves) == 3 and len(benches) == 2 * 2 * 3 and len(cmds) == 15
    assert cmds[:3] == serves  # servers first: they are all started before any run
    assert len({_flag(c, "--port") for c in serves}) == 3
    for c in serves:
        assert _flag(c, "--gpu-memory-utilization") == "0.30"
        assert _flag(c, "--kv-cache-memory-bytes") == str(20 * GIB)
        assert _flag(c, "--max-num-seqs") == "64" and _flag(c, "--max-model-len") == "8960"
    port_of = {_flag(c, "--port"): i for i, c in enumerate(serves)}
    order = [(port_of[_flag(c, "--base-url").rsplit(":", 1)[1]], _flag(c, "--seed"),
              _flag(c, "--random-input-len")) for c in benches]
    assert order == [(i, s, n) for n in ("2048", "4096") for s in ("0", "1") for i in range(3)]
    assert any("ION_UNPACKED_PREFILL=1" in x for x in lines if x.startswith("# server"))
    assert any("540" in x for x in lines if x.startswith("#"))
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- fake vLLM

FAKE_VLLM = textwrap.dedent("""\
    #!{python}
    # Stands in for the interpreter running `-m vllm.entrypoints.cli.main serve|bench serve`.
    import json, os, subprocess, sys, urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        print("Fake GPU 141GB"); sys.exit(0)
    log = os.environ["FAKE_VLLM_LOG"]
    def note(line):
        with open(log, "a") as f:
            f.write(line + "\\n")
    sub = args[2:]
    if sub[:1] == ["serve"]:
        label = sub[sub.index("--attention-backend") + 1]
        if os.environ.get("ION_UNPACKED_PREFILL") == "1":
            label += "+unpacked"
        port = int(sub[sub.index("--port") + 1])
        # an "engine core" child in the server's process group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(os.environ["FAKE_PID_DIR"], f"{{label}}.{{port}}"), "w") as f:
            json.dump({{"pid": os.getpid(), "child": child.pid, "argv": sub}}, f)
        note(f"serve {{label}} {{port}} dev={{os.environ.get('VLLM_SERVER_DEV_MODE')}}")
        if label == os.environ.get("FAKE_SERVE_FAIL"):
            print("CUDA out of memory (fake)"); sys.exit(1)
        hang = label == os.environ.get("FAKE_SERVE_HANG")
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass
            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            def do_GET(self):
                if self.path == "/health":
                    self._send(503 if hang else 200, {{}})
                elif self.path == "/fake_info":
                    self._send(200, {{"label": label, "port": port}})
                else:
                    self._send(404, {{}})
            def do_POST(self):
                if self.path.startswith("/reset_prefix_cache") and \\
                        os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
                    note(f"reset {{label}}")
                    self._send(200, {{"success": True}})
                else:
                    self._send(404, {{}})
        srv = ThreadingHTTPServer(("127.0.0.1", port), H)
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            sys.exit(0)
    if sub[:2] == ["bench", "serve"]:
        base = sub[sub.index("--base-url") + 1]
        info = json.load(urllib.request.urlopen(base + "/fake_info", timeout=10))
        seed = int(sub[sub.index("--seed") + 1])
        note(f"bench {{info['label']}} seed={{seed}} port={{info['port']}}")
        n = sum(1 for line in open(log) if line.startswith("bench "))
        if info["label"] == os.environ.get("FAKE_BENCH_FAIL"):
            print("boom"); sys.exit(3)
        tok = (1100.0 if info["label"].startswith("ION") else 1000.0) + n
        res = {{"date": "20261129-120000", "endpoint_type": "vllm", "backend": "vllm",
                "label": None, "model_id": "m", "tokenizer_id": "m", "num_prompts": 4,
                "request_rate": "inf", "burstiness": 1.0, "max_concurrency": 4,
                "duration": 2.0, "completed": 4, "failed": 0,
                "total_input_tokens": int(tok * 1.6), "total_output_tokens": int(tok * 0.4),
                "request_throughput": 2.0, "request_goodput": None,
                "output_throughput": tok * 0.2, "total_token_throughput": tok,
                "max_output_tokens_per_s": tok * 0.3, "max_concurrent_requests": 4,
                "rtfx": 0.0}}
        for i, m in enumerate(("ttft", "tpot", "itl", "e2el")):
            base_ms = 10.0 * (i + 1) + n
            res.update({{f"mean_{{m}}_ms": base_ms, f"median_{{m}}_ms": base_ms - 0.5,
                         f"std_{{m}}_ms": 1.0, f"p50_{{m}}_ms": base_ms,
                         f"p99_{{m}}_ms": base_ms * 2}})
        d = sub[sub.index("--result-dir") + 1]
        os.makedirs(d, exist_ok=True)  # as vLLM's compute_result_filename does
        with open(os.path.join(d, sub[sub.index("--result-filename") + 1]), "w") as f:
            json.dump(res, f)
        print(f"Total token throughput (tok/s): {{tok:.2f}}")
        sys.exit(0)
    print("unexpected", args); sys.exit(9)
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    p = tmp_path / "fakepy"
    p.write_text(FAKE_VLLM.format(python=sys.executable))
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.setenv("FAKE_PID_DIR", str(pids))
    for k in ("FAKE_SERVE_FAIL", "FAKE_SERVE_HANG", "FAKE_BENCH_FAIL"):
        monkeypatch.delenv(k, raising=False)
    return p, log, pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody reaped yet is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _servers(pids_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(pids_dir.iterdir())]


def _assert_all_dead(pids_dir: Path, n: int):
    procs = _servers(pids_dir)
    assert len(procs) == n
    deadline = time.monotonic() + 15
    left = [p for s in procs for p in (s["pid"], s["child"])]
    while left and time.monotonic() < deadline:
        left = [p for p in left if _alive(p)]
        time.sleep(0.1)
    for p in left:  # don't leak them into other tests, then fail
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"still running: {left}"


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_colocated_run_loop_records(tmp_path, fake, capsys):
    py, log, pids = fake
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--serve", "--colocate", "--workload", "seed,skewed", "--repeats",
                   "2", "--model", str(m), "--out", str(out), "--python", str(py),
                   "--seed", "10"])
    stdout = capsys.readouterr().out
    assert rc == 0, stdout
    _assert_all_dead(pids, 2)  # one server per backend for both workloads, all stopped
    calls = _calls(log)
    serves = [c for c in calls if c.startswith("serve ")]
    assert sorted(c.split()[1] for c in serves) == ["FLASH_ATTN", "ION"]
    assert all(c.endswith("dev=1") for c in serves)
    ports = {c.split()[1]: int(c.split()[2]) for c in serves}
    assert ports["ION"] != ports["FLASH_ATTN"]
    runs = [c for c in calls if not c.startswith("serve ")]
    # every bench run is preceded by a prefix-cache reset of the same server; A/B/A/B;
    # one seed per repeat, the same on both sides
    expect = []
    for _ in ("seed", "skewed"):
        for seed in (10, 11):
            for b in ("ION", "FLASH_ATTN"):
                expect += [f"reset {b}", f"bench {b} seed={seed} port={ports[b]}"]
    assert runs == expect
    s = report.load_summary(out)
    recs = {(r["case"], r["backend"]): r for r in s["records"]}
    assert set(recs) == {(c, b) for c in ("seed-serve", "skewed-serve")
                         for b in ("ION", "FLASH_ATTN")}
    for (case, b), rec in recs.items():
        assert rec["suite"] == "e2e" and rec["status"] == "ok" and rec["repeats"] == 2
        srv = rec["server"]
        assert srv["colocated"] is True and srv["port"] == ports[b]
        assert 0 < srv["startup_s"] < 60
        argv = srv["argv"]
        assert argv[3] == "serve" and _flag(argv, "--port") == str(ports[b])
        assert _flag(argv, "--gpu-memory-utilization") == "0.45"
        assert _flag(argv, "--kv-cache-memory-bytes") == str(40 * GIB)
        assert _flag(argv, "--max-model-len") == "8960"  # skewed's 8755, rounded up
        assert _flag(argv, "--max-num-seqs") == "64"
        assert [r["seed"] for r in rec["runs"]] == [10, 11]
        assert [r["repeat"] for r in rec["runs"]] == [0, 1]
        assert all(r["prefix_cache_reset"] is True for r in rec["runs"])
        assert rec["workload"]["prefix_caching"] is True
    # the numbers come from the bench-serve JSON (n = bench call number, 1-based)
    ion, fa = recs[("seed-serve", "ION")], recs[("seed-serve", "FLASH_ATTN")]
    assert [r["total_tok_s"] for r in ion["runs"]] == [1101.0, 1103.0]
    assert [r["total_tok_s"] for r in fa["runs"]] == [1002.0, 1004.0]
    assert ion["runs"][0]["output_tok_s"] == pytest.approx(1101 * 0.2)
    assert ion["runs"][0]["ttft_p50_ms"] == 11.0 and ion["runs"][0]["ttft_p99_ms"] == 22.0
    assert ion["runs"][1]["tpot_p99_ms"] == 2 * (20.0 + 3)
    assert ion["runs"][0]["failed"] == 0 and ion["runs"][0]["completed"] == 4
    assert ion["ttft_p50_ms"] == pytest.approx((11.0 + 13.0) / 2)
    rat = ion["ratio_total_tok_s_vs_FLASH_ATTN"]
    assert rat["ratio"] == pytest.approx(1102 / 1003) and rat["pairs"] == 2
    assert "ratio_total_tok_s_vs_FLASH_ATTN" not in fa
    sk = recs[("skewed-serve", "ION")]
    assert [r["total_tok_s"] for r in sk["runs"]] == [1105.0, 1107.0]
    assert (out / "raw" / "skewed-serve-FLASH_ATTN-r1.json").exists()
    assert (out / "logs" / "colocated-ION.server.log").read_text().startswith("$ ")
    table = (out / "table.md").read_text()
    assert "| seed-serve |" in table and "| skewed-serve |" in table
    assert "healthy on port" in stdout

    # --accumulate: a third repeat with the next seed, appended to the records
    rc = cli.main(["e2e", "--serve", "--colocate", "--workload", "seed", "--repeats", "1",
                   "--model", str(m), "--out", str(out), "--python", str(py), "--seed", "10",
                   "--accumulate"])
    assert rc == 0
    recs = {(r["case"], r["backend"]): r for r in report.load_summary(out)["records"]}
    assert [r["seed"] for r in recs[("seed-serve", "ION")]["runs"]] == [10, 11, 12]
    assert recs[("seed-serve", "FLASH_ATTN")]["repeats"] == 3
    assert recs[("skewed-serve", "ION")]["repeats"] == 2  # untouched
    _assert_all_dead(pids, 4)


def test_ion_variant_server_gets_its_switch(tmp_path, fake):
    py, log, pids = fake
    opts = _opts(tmp_path, backends=("ION", "ION+unpacked", "FLASH_ATTN"), repeats=1,
                 python=str(py))
    recs = e2e.run_serve_colocated([W["decode-heavy"]], opts, tmp_path / "o",
                                   log=lambda s: None)
    _assert_all_dead(pids, 3)
    assert [c.split()[1] for c in _calls(log) if c.startswith("bench ")] == \
        ["ION", "ION+unpacked", "FLASH_ATTN"]
    by = {r["backend"]: r for r in recs}
    assert _flag(by["ION+unpacked"]["server"]["argv"], "--gpu-memory-utilization") == "0.30"
    assert "ratio_total_tok_s_vs_FLASH_ATTN" in by["ION+unpacked"]
    assert len({r["server"]["port"] for r in recs}) == 3


def test_server_that_dies_is_recorded_and_the_other_side_runs(tmp_path, fake, monkeypatch):
    py, log, pids = fake
    monkeypatch.setenv("FAKE_SERVE_FAIL", "FLASH_ATTN")
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--serve", "--colocate", "--workload", "seed,long", "--repeats",
                   "2", "--model", str(m), "--out", str(out), "--python", str(py)])
    assert rc == 1
    _assert_all_dead(pids, 2)
    assert [c.split()[1] for c in _calls(log) if c.startswith("bench ")] == ["ION"] * 4
    recs = {(r["case"], r["backend"]): r for r in report.load_summary(out)["records"]}
    for case in ("seed-serve", "long-serve"):
        fa, ion = recs[(case, "FLASH_ATTN")], recs[(case, "ION")]
        assert fa["status"] == "error" and "server failed" in fa["error"]
        assert "exited with code 1" in fa["error"]
        assert fa["server"]["startup_s"] is None and "error" in fa["server"]
        assert ion["status"] == "ok" and ion["repeats"] == 2
        assert "ratio_total_tok_s_vs_FLASH_ATTN" not in ion
        assert ion["server"]["startup_s"] > 0
    assert "Not measured" in (out / "table.md").read_text()


def test_server_that_never_gets_healthy_times_out(tmp_path, fake, monkeypatch):
    py, log, pids = fake
    monkeypatch.setenv("FAKE_SERVE_HANG", "ION")
    opts = _opts(tmp_path, repeats=1, python=str(py), server_timeout=3.0)
    t0 = time.monotonic()
    recs = e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None)
    assert time.monotonic() - t0 < 40
    _assert_all_dead(pids, 2)  # the hanging server is stopped too
    by = {r["backend"]: r for r in recs}
    assert by["ION"]["status"] == "error" and "TimeoutError" in by["ION"]["error"]
    assert by["FLASH_ATTN"]["status"] == "ok"
    assert [c.split()[1] for c in _calls(log) if c.startswith("bench ")] == ["FLASH_ATTN"]


def test_failed_bench_run_is_recorded(tmp_path, fake, monkeypatch):
    py, _log, pids = fake
    monkeypatch.setenv("FAKE_BENCH_FAIL", "ION")
    opts = _opts(tmp_path, repeats=2, python=str(py))
    recs = e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None)
    _assert_all_dead(pids, 2)
    by = {r["backend"]: r for r in recs}
    assert by["ION"]["status"] == "error" and "rc=3" in by["ION"]["error"]
    assert by["FLASH_ATTN"]["status"] == "ok" and by["FLASH_ATTN"]["repeats"] == 2


def test_interrupt_stops_every_server(tmp_path, fake, monkeypatch):
    py, _log, pids = fake
    real = e2e._run_logged
    n = []

    def interrupted(*a, **k):
        n.append(1)
        if len(n) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(e2e, "_run_logged", interrupted)
    opts = _opts(tmp_path, repeats=2, python=str(py))
    flushed = []
    with pytest.raises(KeyboardInterrupt):
        e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None,
                                on_records=flushed.append)
    _assert_all_dead(pids, 2)
    assert len(flushed) == 1 and flushed[0][0]["runs"]  # the finished run was flushed


def test_time_budget_skips_runs_and_keeps_pairs(tmp_path, fake, monkeypatch):
    """Each bench run takes 100 s on a fake clock; budget 250 s: three runs start (at 0,
    100, 200), the rest are skipped; the cut repeat's ION run has no FLASH_ATTN partner
    and is kept out of the means."""
    py, log, pids = fake
    now = [0.0]
    real = e2e._run_logged

    def slow(*a, **k):
        r = real(*a, **k)
        now[0] += 100.0
        return r
    monkeypatch.setattr(e2e, "_run_logged", slow)
    opts = _opts(tmp_path, repeats=2, python=str(py), time_budget=250.0)
    lines = []
    recs = e2e.run_serve_colocated([W["seed"], W["skewed"]], opts, tmp_path / "o",
                                   log=lines.append, t_start=0.0, clock=lambda: now[0])
    _assert_all_dead(pids, 2)
    assert [c.split()[1:3] for c in _calls(log) if c.startswith("bench ")] == [
        ["ION", "seed=0"], ["FLASH_ATTN", "seed=0"], ["ION", "seed=1"]]
    by = {(r["case"], r["backend"]): r for r in recs}
    ion, fa = by[("seed-serve", "ION")], by[("seed-serve", "FLASH_ATTN")]
    assert [r["repeat"] for r in ion["runs"]] == [0] and ion["status"] == "ok"
    assert [r["repeat"] for r in ion["unpaired_runs"]] == [1]
    assert "kept out of the means" in ion["warning"]
    assert [r["repeat"] for r in fa["runs"]] == [0]
    assert "repeat(s) [1] not run" in fa["warning"]
    assert ion["ratio_total_tok_s_vs_FLASH_ATTN"]["pairs"] == 1
    assert ion["total_tok_s"] == 1101.0  # r1 (1103) is not in the mean
    for b in ("ION", "FLASH_ATTN"):
        sk = by[("skewed-serve", b)]
        assert sk["status"] == "skipped" and sk["runs"] == []
        assert "time budget 250s spent" in sk["error"]
    skip_line = [x for x in lines if "skipped 5 bench run(s)" in x]
    assert skip_line and "skewed/FLASH_ATTN/r1" in skip_line[0]


def test_budget_spent_before_start_starts_nothing(tmp_path, fake, monkeypatch):
    py, _log, _pids = fake

    def no_popen(*a, **k):
        raise AssertionError("no server may start")
    monkeypatch.setattr(e2e.subprocess, "Popen", no_popen)
    opts = _opts(tmp_path, repeats=1, python=str(py), time_budget=5.0)
    recs = e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None,
                                   t_start=time.monotonic() - 10.0)
    assert [r["status"] for r in recs] == ["skipped", "skipped"]
    assert all("time budget 5s spent" in r["error"] for r in recs)


def test_budget_caps_the_health_wait(tmp_path, fake, monkeypatch):
    """A server still starting when the budget runs out is given up on at once (not
    after --server-timeout); the server that came up runs nothing either."""
    py, log, pids = fake
    monkeypatch.setenv("FAKE_SERVE_HANG", "ION")
    opts = _opts(tmp_path, repeats=1, python=str(py), time_budget=4.0, server_timeout=600)
    t0 = time.monotonic()
    recs = e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None,
                                   t_start=time.monotonic())
    assert time.monotonic() - t0 < 40
    _assert_all_dead(pids, 2)
    assert not [c for c in _calls(log) if c.startswith("bench ")]
    by = {r["backend"]: r for r in recs}
    assert by["ION"]["status"] == "error"
    assert "capped by the 4s time budget" in by["ION"]["error"]
    assert by["FLASH_ATTN"]["status"] == "skipped"
    assert by["FLASH_ATTN"]["server"]["startup_s"] > 0


def test_cli_budget_skips_are_not_failures(tmp_path, fake, monkeypatch, capsys):
    """Through the CLI: what the budget skipped is status 'skipped' and the exit code
    stays 0 (the runs that fit are the result)."""
    py, _log, pids = fake
    real = e2e.run_serve_colocated

    def with_clock(*a, **k):
        now = [0.0]
        real_run = e2e._run_logged

        def slow(*aa, **kk):
            r = real_run(*aa, **kk)
            now[0] += 100.0
            return r
        monkeypatch.setattr(e2e, "_run_logged", slow)
        k["t_start"] = 0.0
        return real(*a, clock=lambda: now[0], **k)
    monkeypatch.setattr(e2e, "run_serve_colocated", with_clock)
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--colocate", "--workload", "seed,long", "--repeats", "1",
                   "--model", str(m), "--out", str(out), "--python", str(py),
                   "--time-budget", "150"])
    assert rc == 0
    _assert_all_dead(pids, 2)
    recs = {(r["case"], r["backend"]): r["status"]
            for r in report.load_summary(out)["records"]}
    assert recs == {("seed-serve", "ION"): "ok", ("seed-serve", "FLASH_ATTN"): "ok",
                    ("long-serve", "ION"): "skipped", ("long-serve", "FLASH_ATTN"): "skipped"}
    assert "not run within the time budget" in capsys.readouterr().out


def test_non_colocated_serve_uses_per_repeat_seeds(tmp_path, fake):
    """The fixed run_serve: one server per (workload, backend), repeat r benchmarks with
    --seed seed + r on both sides."""
    py, log, pids = fake
    opts = _opts(tmp_path, repeats=2, seed=4, python=str(py))
    recs = e2e.run_serve([W["seed"]], opts, tmp_path / "o", log=lambda s: None)
    _assert_all_dead(pids, 2)
    assert [c.split()[1:3] for c in _calls(log) if c.startswith("bench ")] == [
        ["ION", "seed=4"], ["ION", "seed=5"], ["FLASH_ATTN", "seed=4"], ["FLASH_ATTN", "seed=5"]]
    assert [(r["status"], [x["seed"] for x in r["runs"]]) for r in recs] == [("ok", [4, 5])] * 2, recs


def test_server_that_cannot_be_started_is_recorded(tmp_path, fake):
    _py, log, pids = fake
    opts = _opts(tmp_path, repeats=1, python=str(tmp_path / "no-such-python"))
    recs = e2e.run_serve_colocated([W["seed"]], opts, tmp_path / "o", log=lambda s: None)
    assert [r["status"] for r in recs] == ["error", "error"]
    assert all("could not start vllm serve" in r["error"] for r in recs)
    assert not _calls(log) and not list(pids.iterdir())
