"""ion-bench CLI and the e2e driver on CPU: help, subset selection, dry-run,
command construction validated by vLLM's own parsers, result parsing, and the
A/B/A/B run loop against a fake vLLM interpreter."""

import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ion_vllm.bench import cli, e2e, report

ROOT = Path(__file__).resolve().parents[1]


def _run_cli(*args, cwd=ROOT):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "ion_vllm.bench.cli", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_help_lists_subcommands():
    r = _run_cli("--help")
    assert r.returncode == 0
    for sub in ("kernel", "e2e", "report"):
        assert sub in r.stdout
    for sub in ("kernel", "e2e"):
        r = _run_cli(sub, "--help")
        assert r.returncode == 0 and "--backends" in r.stdout and "--out" in r.stdout
    assert "--dry-run" in _run_cli("e2e", "--help").stdout


def test_kernel_list_subset_selection(capsys):
    assert cli.main(["kernel", "--suite", "smoke", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["decode-32x8192-h28/4-d128",
                                                 "mixed-32x8192+p2048-h28/4-d128"]
    assert cli.main(["kernel", "--case", "prefill-1x8192-h28/4-d128,decode-8x32768-h28/4-d128",
                     "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["prefill-1x8192-h28/4-d128",
                                                 "decode-8x32768-h28/4-d128"]
    assert cli.main(["kernel", "--suite", "gqa", "--suite", "pages", "--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 16  # 12 gqa + 4 pages
    assert cli.main(["kernel", "--case", "nope", "--list"]) == 2
    assert cli.main(["kernel", "--backends", "ion,cudnn", "--list"]) == 2


def _model_dir(tmp_path, weights=False):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    if weights:
        (d / "model.safetensors").write_bytes(b"x")
    return d


def test_e2e_dry_run_prints_interleaved_commands(tmp_path, capsys):
    m = _model_dir(tmp_path)
    assert cli.main(["e2e", "--workload", "seed,skewed", "--repeats", "2", "--model", str(m),
                     "--dry-run", "--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmds = [shlex.split(x) for x in lines if not x.startswith("#")]
    assert len(cmds) == 8
    backs = [c[c.index("--attention-backend") + 1] for c in cmds]
    assert backs == ["ION", "FLASH_ATTN"] * 4
    for c in cmds:
        assert c[1:5] == ["-m", "vllm.entrypoints.cli.main", "bench", "throughput"]
        assert c[c.index("--load-format") + 1] == "dummy"
        assert c[c.index("--seed") + 1] == "0"
    # both sides identical except the backend and the output file
    def strip(c):
        c = list(c)
        for flag in ("--attention-backend", "--output-json"):
            i = c.index(flag)
            del c[i:i + 2]
        return c
    assert strip(cmds[0]) == strip(cmds[1]) == strip(cmds[2])
    sk = cmds[4]
    assert sk[sk.index("--random-range-ratio") + 1] == "0.9"
    assert sk[sk.index("--max-num-seqs") + 1] == "64"
    assert not (tmp_path / "o").exists()  # dry run writes nothing


def test_serve_dry_run(tmp_path, capsys):
    m = _model_dir(tmp_path, weights=True)
    assert cli.main(["e2e", "--serve", "--workload", "long", "--model", str(m),
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "vllm.entrypoints.cli.main serve" in out and "bench serve" in out
    assert "--load-format" not in out  # the dir has weights
    assert "--metric-percentiles 50,99" in out


def test_workload_table():
    w = e2e.WORKLOADS
    assert (w["seed"].input_len, w["seed"].output_len, w["seed"].concurrency,
            w["seed"].num_prompts) == (7680, 512, 32, 64)
    assert (w["decode-heavy"].input_len, w["decode-heavy"].output_len,
            w["decode-heavy"].concurrency) == (2048, 2048, 64)
    assert (w["long"].output_len, w["long"].concurrency) == (1024, 8)
    assert 30000 <= w["long"].input_len <= 31000
    assert w["skewed"].range_ratio == 0.9 and w["skewed"].concurrency == 64
    assert w["shared-prefix"].dataset == "prefix_repetition"
    assert w["shared-prefix"].prefix_caching is True
    with pytest.raises(KeyError):
        e2e.select_workloads(["nope"])
    assert [x.name for x in e2e.select_workloads(["all"])] == list(w)


def test_commands_accepted_by_vllm_parsers(tmp_path):
    """Every planned command parses with vLLM 0.26's own parsers (bench throughput
    also passes its validate_args), and the parsed values are the intended ones."""
    pytest.importorskip("vllm")
    m = _model_dir(tmp_path)
    opts = e2e.E2EOptions(model=str(m), repeats=1, disable_detokenize=True,
                          max_model_len=32768, extra_args=("--gpu-memory-utilization", "0.85"))
    ws = e2e.select_workloads(["all"])
    plan = e2e.plan_throughput(ws, opts, tmp_path)
    cmds = [c for *_, c, _ in plan]
    cmds += [e2e.serve_cmd(w, "ION", opts, 8123) for w in ws]
    cmds += [e2e.bench_serve_cmd(w, opts, 8123, str(tmp_path), "r.json") for w in ws]
    bad = e2e.throughput_cmd(ws[0], "ION", opts, "x.json") + ["--no-such-flag"]
    res = e2e.check_with_vllm_parser(cmds + [bad])
    assert [r["ok"] for r in res] == [True] * len(cmds) + [False], \
        [r.get("error") for r in res]
    tp = res[:len(plan)]
    for (w, b, _, _, js), r in zip(plan, tp):
        a = r["args"]
        assert a["attention_backend"] == b
        assert a["max_num_seqs"] == w.concurrency
        assert a["num_prompts"] == w.num_prompts
        assert a["load_format"] == "dummy"
        assert a["seed"] == 0 and a["disable_detokenize"] is True
        assert a["output_json"] == str(js)
        assert a["max_model_len"] == 32768 and a["gpu_memory_utilization"] == 0.85
        assert a["dataset_name"] == w.dataset
        if w.dataset == "random":
            assert a["random_input_len"] == w.input_len
            assert a["random_output_len"] == w.output_len
        else:
            assert a["prefix_repetition_prefix_len"] == w.prefix_len
            assert a["prefix_repetition_suffix_len"] == w.input_len
            assert a["enable_prefix_caching"] is True
    serve = res[len(plan):len(plan) + len(ws)]
    assert all(r["args"]["attention_backend"] == "ION" for r in serve)
    assert all(r["args"]["port"] == 8123 for r in serve)
    bs = res[len(plan) + len(ws):len(plan) + 2 * len(ws)]
    assert all(r["args"]["max_concurrency"] == w.concurrency for r, w in zip(bs, ws))
    assert all(r["args"]["ignore_eos"] is True for r in bs)


def test_parse_throughput_json_and_stdout(tmp_path):
    js = tmp_path / "r.json"
    js.write_text(json.dumps({"elapsed_time": 10.0, "num_requests": 64,
                              "total_num_tokens": 524288, "requests_per_second": 6.4,
                              "tokens_per_second": 52428.8}))
    out = ("INFO blah\nThroughput: 6.40 requests/s, 52428.80 total tokens/s, "
           "3276.80 output tokens/s\nTotal num prompt tokens:  491520\n"
           "Total num output tokens:  32768\n")
    r = e2e.parse_throughput(js, out)
    assert r["total_tok_s"] == 52428.8 and r["output_tok_s"] == 3276.8
    assert r["elapsed_s"] == 10.0 and r["num_requests"] == 64
    r2 = e2e.parse_throughput(js, "Total num output tokens:  32768\n")
    assert r2["output_tok_s"] == pytest.approx(3276.8)
    assert e2e.parse_throughput(tmp_path / "missing.json", "nothing") == {}


def test_parse_bench_serve(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"total_token_throughput": 900.0, "output_throughput": 100.0,
                             "request_throughput": 1.0, "duration": 5.0, "completed": 5,
                             "median_ttft_ms": 50.0, "p50_ttft_ms": 51.0, "p99_ttft_ms": 90.0,
                             "p50_tpot_ms": 9.0, "p99_tpot_ms": 12.0}))
    r = e2e.parse_bench_serve(p)
    assert r["ttft_p50_ms"] == 51.0 and r["ttft_p99_ms"] == 90.0
    assert r["tpot_p50_ms"] == 9.0 and r["tpot_p99_ms"] == 12.0
    assert r["total_tok_s"] == 900.0 and r["output_tok_s"] == 100.0


FAKE_VLLM = textwrap.dedent("""\
    #!{python}
    # Stands in for the interpreter running `-m vllm.entrypoints.cli.main bench throughput`.
    import json, os, sys
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        print("Fake GPU 141GB"); sys.exit(0)
    log = os.environ["FAKE_VLLM_LOG"]
    be = args[args.index("--attention-backend") + 1]
    if os.environ.get("ION_UNPACKED_PREFILL") == "1":
        be += "+unpacked"  # what the run saw: the switch reached the vLLM process
    with open(log, "a") as f:
        f.write(be + "\\n")
    n = sum(1 for _ in open(log))
    if be == os.environ.get("FAKE_VLLM_FAIL"):
        print("boom"); sys.exit(3)
    tok = (1100.0 if be == "ION" else 1000.0) + n
    out = tok / 10
    json.dump({{"elapsed_time": 2.0, "num_requests": 4, "total_num_tokens": tok * 2,
               "requests_per_second": 2.0, "tokens_per_second": tok}},
              open(args[args.index("--output-json") + 1], "w"))
    print(f"Throughput: 2.00 requests/s, {{tok:.2f}} total tokens/s, {{out:.2f}} output tokens/s")
""")


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    p = tmp_path / "fakepy"
    p.write_text(FAKE_VLLM.format(python=sys.executable))
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return p, log


def test_e2e_run_loop_interleaves_and_aggregates(tmp_path, fake_python, capsys):
    fake, log = fake_python
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--workload", "seed", "--repeats", "2", "--model", str(m),
                   "--out", str(out), "--python", str(fake)])
    assert rc == 0
    assert log.read_text().split() == ["ION", "FLASH_ATTN", "ION", "FLASH_ATTN"]
    s = report.load_summary(out)
    recs = {r["backend"]: r for r in s["records"]}
    assert set(recs) == {"ION", "FLASH_ATTN"}
    ion, fa = recs["ION"], recs["FLASH_ATTN"]
    assert ion["suite"] == "e2e" and ion["case"] == "seed" and ion["repeats"] == 2
    assert [r["total_tok_s"] for r in ion["runs"]] == [1101.0, 1103.0]
    assert [r["total_tok_s"] for r in fa["runs"]] == [1002.0, 1004.0]
    assert ion["total_tok_s"] == 1102.0 and ion["total_tok_s_min"] == 1101.0
    assert fa["output_tok_s"] == pytest.approx(100.3)
    rat = ion["ratio_total_tok_s_vs_FLASH_ATTN"]
    assert rat["ratio"] == pytest.approx(1102 / 1003)
    assert rat["ratio_min"] == pytest.approx(1103 / 1004)
    assert rat["ratio_max"] == pytest.approx(1101 / 1002)
    assert s["ceilings"]["gpu"] == "Fake GPU 141GB"
    assert (out / "table.md").exists() and (out / "plot.png").stat().st_size > 5000
    assert "| seed |" in (out / "table.md").read_text()
    assert (out / "logs" / "seed-ION-r0.log").exists()

    # --accumulate adds a third repeat per side instead of replacing the record
    rc = cli.main(["e2e", "--workload", "seed", "--repeats", "1", "--model", str(m),
                   "--out", str(out), "--python", str(fake), "--accumulate"])
    assert rc == 0
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert [r["total_tok_s"] for r in recs["ION"]["runs"]] == [1101.0, 1103.0, 1105.0]
    assert recs["ION"]["repeats"] == 3 and recs["FLASH_ATTN"]["repeats"] == 3
    assert recs["ION"]["runs"][2]["repeat"] == 2

    # without it the re-run replaces the matching records
    rc = cli.main(["e2e", "--workload", "seed", "--repeats", "1", "--model", str(m),
                   "--out", str(out), "--python", str(fake)])
    assert rc == 0
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert recs["ION"]["repeats"] == 1


def test_e2e_ion_variant_runs_ion_with_its_switch(tmp_path, fake_python):
    """`--backends ION,ION+unpacked,FLASH_ATTN`: the variant runs --attention-backend ION
    with ION_UNPACKED_PREFILL=1 in its environment (and only there), and gets its own
    ratio against FLASH_ATTN and its own table columns."""
    fake, log = fake_python
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--workload", "seed", "--repeats", "1", "--model", str(m),
                   "--out", str(out), "--python", str(fake),
                   "--backends", "ION,ION+unpacked,FLASH_ATTN"])
    assert rc == 0
    assert log.read_text().split() == ["ION", "ION+unpacked", "FLASH_ATTN"]
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert "ratio_total_tok_s_vs_FLASH_ATTN" in recs["ION+unpacked"]
    assert "ratio_total_tok_s_vs_FLASH_ATTN" in recs["ION"]
    table = (out / "table.md").read_text()
    assert "ION+unpacked/FA total" in table and "ION/FA total" in table


def test_e2e_failure_is_recorded_not_raised(tmp_path, fake_python, monkeypatch):
    fake, log = fake_python
    monkeypatch.setenv("FAKE_VLLM_FAIL", "ION")
    m = _model_dir(tmp_path)
    out = tmp_path / "res"
    rc = cli.main(["e2e", "--workload", "decode-heavy", "--repeats", "1", "--model", str(m),
                   "--out", str(out), "--python", str(fake)])
    assert rc == 1
    recs = {r["backend"]: r for r in report.load_summary(out)["records"]}
    assert recs["ION"]["status"] == "error" and "rc=3" in recs["ION"]["error"]
    assert recs["FLASH_ATTN"]["status"] == "ok"
    assert "Not measured" in (out / "table.md").read_text()


def test_report_subcommand(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    report.save_summary(tmp_path, {"ceilings": {}, "records": [
        {"suite": "kernel", "case": "c", "backend": "ion", "status": "ok", "median_us": 2.0},
        {"suite": "kernel", "case": "c", "backend": "fa3", "status": "ok", "median_us": 3.0}]})
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "| c |" in (tmp_path / "table.md").read_text()
    assert "1.50x" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "plot.png").exists()


def test_scripts_pass_arguments_through(tmp_path):
    for name, sub in (("bench_kernel.sh", "kernel"), ("bench_e2e.sh", "e2e")):
        script = ROOT / "scripts" / name
        assert script.exists()
        text = script.read_text()
        assert "python3 -m ion_vllm.bench.cli " + sub in text and '"$@"' in text
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bench_kernel.sh"), "--suite", "smoke",
                        "--list"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    assert "decode-32x8192-h28/4-d128" in r.stdout


def test_e2e_variants_reach_the_backend_switches():
    """ION+packed reproduces the pre-2026-11-29 default (packed 64-row tiles); ION+m64 keeps
    unpacked tiles but never 128-row ones.  The switch names are the backend's own."""
    import ion_vllm.backend as backend_mod
    from ion_vllm.bench import e2e

    assert e2e.resolve_backend("ION+packed") == (
        "ION", {backend_mod.UNPACKED_PREFILL_ENV: "0", backend_mod.PREFILL_TILE_M_ENV: "64"})
    assert e2e.resolve_backend("ION+m64") == ("ION", {backend_mod.PREFILL_TILE_M_ENV: "64"})
    assert e2e.resolve_backend("FLASH_ATTN") == ("FLASH_ATTN", {})
