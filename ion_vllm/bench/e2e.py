"""End-to-end A/B: vLLM's own ``bench throughput`` (and optionally ``serve`` +
``bench serve``) with ``--attention-backend ION`` vs ``--attention-backend FLASH_ATTN``.

Everything runs as subprocesses of ``python3 -m vllm.entrypoints.cli.main`` (no
``vllm`` script on PATH needed).  Both sides get exactly the same flags except
``--attention-backend``; repeats are interleaved A/B/A/B.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import report

VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
DEFAULT_MODEL_DIR = Path("bench") / "demo-model"
DEMO_MODEL_SCRIPT = Path("scripts") / "make_demo_model.py"


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    dataset: str = "random"              # "random" | "prefix_repetition"
    range_ratio: float | None = None     # random dataset only
    prefix_len: int = 0                  # prefix_repetition only
    num_prefixes: int = 0                # prefix_repetition only
    prefix_caching: bool | None = None   # None = vLLM default
    note: str = ""

    @property
    def max_prompt_len(self) -> int:
        if self.dataset == "prefix_repetition":
            return self.prefix_len + self.input_len
        r = self.range_ratio or 0.0
        return int(self.input_len * (1 + r))


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("seed", 7680, 512, 32, 64, note="the anchor: 7.5k prompt, 512 out, 32 in flight"),
    Workload("decode-heavy", 2048, 2048, 64, 64, note="decode-dominated"),
    Workload("long", 30720, 1024, 8, 16, note="30k context, 8 in flight"),
    Workload("skewed", 4096, 512, 64, 128, range_ratio=0.9,
             note="input/output lengths uniform in [0.1x, 1.9x]"),
    Workload("shared-prefix", 512, 512, 32, 64, dataset="prefix_repetition",
             prefix_len=6144, num_prefixes=4, prefix_caching=True,
             note="4 shared 6k prefixes + 512 unique tokens each, prefix caching on"),
)}

BACKENDS = ("ION", "FLASH_ATTN")

#: ION variants for the A/B: a label, run as ``--attention-backend ION`` with the backend's
#: opt-in switches set in the environment (ion_vllm/backend.py)
ION_VARIANTS: dict[str, dict[str, str]] = {
    "ION+unpacked": {"ION_UNPACKED_PREFILL": "1"},
    "ION+fused": {"ION_FUSED_KV_WRITEBACK": "1"},
    "ION+fused+unpacked": {"ION_FUSED_KV_WRITEBACK": "1", "ION_UNPACKED_PREFILL": "1"},
}


def resolve_backend(label: str) -> tuple[str, dict[str, str]]:
    """(vLLM --attention-backend value, extra environment) of a backend label."""
    if label in ION_VARIANTS:
        return "ION", dict(ION_VARIANTS[label])
    return label, {}


def backend_env(label: str, opts: "E2EOptions") -> dict[str, str]:
    env = dict(opts.env)
    env.update(resolve_backend(label)[1])
    return env


@dataclass
class E2EOptions:
    model: str
    backends: tuple[str, ...] = BACKENDS
    repeats: int = 2
    seed: int = 0
    num_prompts: int | None = None
    disable_detokenize: bool = False
    load_format: str | None = None       # None: "dummy" iff the model dir has no weights
    num_warmups: int = 4
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable
    run_timeout: float = 1800.0
    server_timeout: float = 900.0
    env: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- commands

def model_has_weights(model: str | os.PathLike) -> bool:
    p = Path(model)
    if not p.is_dir():
        return True  # not a local dir: let vLLM resolve it
    return any(f.name.endswith(WEIGHT_SUFFIXES) for f in p.iterdir())


def load_format_for(opts: E2EOptions) -> str | None:
    if opts.load_format:
        return opts.load_format
    return None if model_has_weights(opts.model) else "dummy"


def _dataset_args(w: Workload, num_prompts: int) -> list[str]:
    if w.dataset == "random":
        args = ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len)]
        if w.range_ratio is not None:
            args += ["--random-range-ratio", str(w.range_ratio)]
    elif w.dataset == "prefix_repetition":
        args = ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(w.prefix_len),
                "--prefix-repetition-suffix-len", str(w.input_len),
                "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                "--prefix-repetition-output-len", str(w.output_len)]
    else:
        raise ValueError(f"unknown dataset {w.dataset}")
    return args + ["--num-prompts", str(num_prompts)]


def _engine_args(w: Workload, backend: str, opts: E2EOptions) -> list[str]:
    args = ["--attention-backend", resolve_backend(backend)[0],
            "--max-num-seqs", str(w.concurrency),
            "--seed", str(opts.seed)]
    lf = load_format_for(opts)
    if lf:
        args += ["--load-format", lf]
    if w.prefix_caching is True:
        args += ["--enable-prefix-caching"]
    elif w.prefix_caching is False:
        args += ["--no-enable-prefix-caching"]
    if opts.max_model_len:
        args += ["--max-model-len", str(opts.max_model_len)]
    return args


def _warmups(w: Workload, opts: E2EOptions) -> int:
    # prefix_repetition needs at least one prompt per prefix, warm-up included
    if w.dataset == "prefix_repetition":
        return max(opts.num_warmups, w.num_prefixes)
    return opts.num_warmups


def num_prompts_for(w: Workload, opts: E2EOptions) -> int:
    return opts.num_prompts if opts.num_prompts else w.num_prompts


def throughput_cmd(w: Workload, backend: str, opts: E2EOptions, output_json: str) -> list[str]:
    """``vllm bench throughput`` for one side of the A/B."""
    cmd = [opts.python, *VLLM_CLI, "bench", "throughput", "--backend", "vllm",
           "--model", str(opts.model)]
    cmd += _dataset_args(w, num_prompts_for(w, opts))
    cmd += _engine_args(w, backend, opts)
    if opts.num_warmups:
        cmd += ["--num-warmups", str(_warmups(w, opts))]
    if opts.disable_detokenize:
        cmd += ["--disable-detokenize"]
    cmd += ["--output-json", str(output_json)]
    cmd += list(opts.extra_args)
    return cmd


def serve_cmd(w: Workload, backend: str, opts: E2EOptions, port: int) -> list[str]:
    cmd = [opts.python, *VLLM_CLI, "serve", str(opts.model), "--host", "127.0.0.1",
           "--port", str(port)]
    cmd += _engine_args(w, backend, opts)
    cmd += list(opts.extra_args)
    return cmd


def bench_serve_cmd(w: Workload, opts: E2EOptions, port: int, result_dir: str,
                    result_file: str) -> list[str]:
    cmd = [opts.python, *VLLM_CLI, "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", str(opts.model)]
    cmd += _dataset_args(w, num_prompts_for(w, opts))
    cmd += ["--max-concurrency", str(w.concurrency), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(opts.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", str(result_file)]
    if opts.num_warmups:
        cmd += ["--num-warmups", str(_warmups(w, opts))]
    return cmd


def plan_throughput(workloads: list[Workload], opts: E2EOptions, out_dir: Path,
                    offsets: dict[str, int] | None = None):
    """[(workload, backend, repeat, cmd, json_path)] in execution order: per
    workload, repeat r runs every backend in the given order (A/B/A/B).
    Repeat numbers start at ``offsets[workload]`` (runs kept from earlier calls)."""
    plan = []
    for w in workloads:
        first = (offsets or {}).get(w.name, 0)
        for r in range(first, first + opts.repeats):
            for b in opts.backends:
                js = out_dir / "raw" / f"{w.name}-{b}-r{r}.json"
                plan.append((w, b, r, throughput_cmd(w, b, opts, str(js)), js))
    return plan


# --------------------------------------------------------------------------- validation

_PARSE_CHECK = r"""
import json, sys
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
platforms.current_platform = CpuPlatform()
platforms._current_platform = platforms.current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
cmds = json.load(sys.stdin)
res = []
for argv in cmds:
    try:
        i = argv.index("vllm.entrypoints.cli.main") + 1
        sub = argv[i:]
        if sub[:2] == ["bench", "throughput"]:
            from vllm.benchmarks import throughput as mod
            p = FlexibleArgumentParser(prog="vllm bench throughput")
            mod.add_cli_args(p)
            a = p.parse_args(sub[2:])
            mod.validate_args(a)
        elif sub[:2] == ["bench", "serve"]:
            from vllm.benchmarks import serve as mod
            p = FlexibleArgumentParser(prog="vllm bench serve")
            mod.add_cli_args(p)
            a = p.parse_args(sub[2:])
        elif sub[:1] == ["serve"]:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
            p = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
            a = p.parse_args(sub[1:])
        else:
            raise ValueError(f"unknown vllm subcommand {sub[:2]}")
        res.append({"ok": True, "args": {k: v for k, v in vars(a).items()
                                          if isinstance(v, (str, int, float, bool, type(None)))}})
    except SystemExit as e:
        res.append({"ok": False, "error": f"argparse exit {e.code}"})
    except Exception as e:
        res.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print("@@RESULT@@" + json.dumps(res))
"""


def check_with_vllm_parser(cmds: list[list[str]], python: str = sys.executable,
                           timeout: float = 600.0) -> list[dict]:
    """Parse each planned command with vLLM's own argument parser (and, for
    ``bench throughput``, its ``validate_args``) in a CPU-platform subprocess.
    Returns one ``{"ok", "args" | "error"}`` per command."""
    r = subprocess.run([python, "-c", _PARSE_CHECK], input=json.dumps(cmds), text=True,
                       capture_output=True, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"vLLM parser check failed (rc={r.returncode}):\n{r.stderr[-3000:]}")


# --------------------------------------------------------------------------- parsing

_THROUGHPUT_RE = re.compile(
    r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output tokens/s")
_OUT_TOKENS_RE = re.compile(r"Total num output tokens:\s*(\d+)")


def parse_throughput(json_path: str | os.PathLike | None, stdout: str) -> dict:
    """One run's numbers from ``--output-json`` (elapsed, total tok/s) and the
    printed summary line (output tok/s, which the JSON does not carry)."""
    res: dict = {}
    if json_path and Path(json_path).exists():
        js = json.loads(Path(json_path).read_text())
        res["elapsed_s"] = js.get("elapsed_time")
        res["num_requests"] = js.get("num_requests")
        res["total_num_tokens"] = js.get("total_num_tokens")
        res["requests_s"] = js.get("requests_per_second")
        res["total_tok_s"] = js.get("tokens_per_second")
    m = None
    for m in _THROUGHPUT_RE.finditer(stdout):
        pass
    if m:
        res.setdefault("requests_s", float(m.group(1)))
        if res.get("total_tok_s") is None:
            res["total_tok_s"] = float(m.group(2))
        res["output_tok_s"] = float(m.group(3))
    else:
        mo = list(_OUT_TOKENS_RE.finditer(stdout))
        if mo and res.get("elapsed_s"):
            res["output_tok_s"] = int(mo[-1].group(1)) / res["elapsed_s"]
    return res


def parse_bench_serve(path: str | os.PathLike) -> dict:
    js = json.loads(Path(path).read_text())

    def g(*keys):
        for k in keys:
            if js.get(k) is not None:
                return js[k]
        return None

    return {
        "total_tok_s": g("total_token_throughput"),
        "output_tok_s": g("output_throughput"),
        "requests_s": g("request_throughput"),
        "elapsed_s": g("duration"),
        "completed": g("completed"),
        "ttft_p50_ms": g("p50_ttft_ms", "median_ttft_ms"),
        "ttft_p99_ms": g("p99_ttft_ms"),
        "tpot_p50_ms": g("p50_tpot_ms", "median_tpot_ms"),
        "tpot_p99_ms": g("p99_tpot_ms"),
        "itl_p50_ms": g("p50_itl_ms", "median_itl_ms"),
        "itl_p99_ms": g("p99_itl_ms"),
    }


def build_records(workload: Workload, runs: dict[str, list[dict]], opts: E2EOptions,
                  case: str | None = None, errors: dict[str, str] | None = None) -> list[dict]:
    """One e2e record per backend from its runs; the ION record also carries the
    ION/FLASH_ATTN ratios (mean ratio and the spread of per-repeat ratios)."""
    case = case or workload.name
    recs = {}
    for b in opts.backends:
        ok = [r for r in runs.get(b, []) if r.get("total_tok_s")]
        rec = {"suite": "e2e", "case": case, "backend": b,
               "workload": {"input_len": workload.input_len, "output_len": workload.output_len,
                            "concurrency": workload.concurrency,
                            "num_prompts": num_prompts_for(workload, opts),
                            "dataset": workload.dataset, "range_ratio": workload.range_ratio,
                            "prefix_len": workload.prefix_len,
                            "num_prefixes": workload.num_prefixes,
                            "prefix_caching": workload.prefix_caching,
                            "seed": opts.seed, "model": str(opts.model),
                            "load_format": load_format_for(opts)},
               "runs": ok}
        rec.update(report.e2e_aggregate(ok))
        lat_keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                    "itl_p50_ms", "itl_p99_ms")
        for k in lat_keys:
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                rec[k] = sum(vals) / len(vals)
        if ok:
            rec["status"] = "ok"
        else:
            rec["status"] = "error"
            rec["error"] = (errors or {}).get(b, "no successful run")
        if errors and b in errors and ok:
            rec["warning"] = errors[b]
        recs[b] = rec
    base = recs.get(report.E2E_BASELINE)
    for label, ion in recs.items():  # ION and its variants, each against FLASH_ATTN
        if not (base and label.startswith(report.ION_E2E)):
            continue
        for key in ("total_tok_s", "output_tok_s"):
            r = report.e2e_ratio(ion, base, key)
            if r:
                ion[f"ratio_{key}_vs_{report.E2E_BASELINE}"] = r
    return list(recs.values())


# --------------------------------------------------------------------------- processes

def _run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
                cwd: str | None = None) -> tuple[int, str]:
    """Run ``cmd`` in its own session, teeing output to ``log_path``; on timeout
    or interrupt the whole process group (vLLM's engine core included) is killed."""
    import threading
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    out: list[str] = []
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(_q(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True,
                                env=full_env, cwd=cwd)

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                out.append(line)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            _kill_group(proc)
            th.join(timeout=10)
            log.write(f"\n[ion-bench] killed: {e!r}\n")
            if isinstance(e, KeyboardInterrupt):
                raise
            return -9, "".join(out)
        th.join(timeout=30)
    return rc, "".join(out)


def _kill_group(proc: subprocess.Popen, grace: float = 20.0):
    """Stop the process group led by ``proc`` (started by us with its own session)."""
    if proc.poll() is not None:
        # Leader is gone; take down any helper it left behind in its group.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _q(s: str) -> str:
    import shlex
    return shlex.quote(str(s))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    url = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(2.0)
    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s")


# --------------------------------------------------------------------------- drivers

def ensure_model(opts: E2EOptions, log=print) -> None:
    """The default demo model dir is created on first use with
    ``scripts/make_demo_model.py`` (offline; no weights)."""
    p = Path(opts.model)
    if p.exists():
        return
    if p == DEFAULT_MODEL_DIR and DEMO_MODEL_SCRIPT.exists():
        log(f"[e2e] creating demo model in {p} with {DEMO_MODEL_SCRIPT}")
        subprocess.run([opts.python, str(DEMO_MODEL_SCRIPT), str(p)], check=True)
        return
    raise FileNotFoundError(
        f"model dir {p} does not exist (create one with: python3 {DEMO_MODEL_SCRIPT} {p})")


def run_throughput(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
                   log=print, on_records=None, prior: dict | None = None) -> list[dict]:
    """``prior[case][backend]``: runs from earlier invocations to keep (``--accumulate``)."""
    prior = prior or {}
    runs: dict[str, dict[str, list[dict]]] = {
        w.name: {b: list(prior.get(w.name, {}).get(b, [])) for b in opts.backends}
        for w in workloads}
    offsets = {}
    for w in workloads:  # keep prior runs pairwise aligned across backends
        n = min(len(v) for v in runs[w.name].values())
        runs[w.name] = {b: v[:n] for b, v in runs[w.name].items()}
        offsets[w.name] = n
    plan = plan_throughput(workloads, opts, out_dir, offsets)
    errors: dict[str, dict[str, str]] = {w.name: {} for w in workloads}
    all_recs: dict[str, list[dict]] = {}
    for i, (w, b, r, cmd, js) in enumerate(plan):
        log(f"[e2e] ({i + 1}/{len(plan)}) {w.name} {b} repeat {r + 1 - offsets[w.name]}/"
            f"{opts.repeats} ...")
        js.parent.mkdir(parents=True, exist_ok=True)
        if js.exists():
            js.unlink()
        t0 = time.monotonic()
        logp = out_dir / "logs" / f"{w.name}-{b}-r{r}.log"
        rc, out = _run_logged(cmd, logp, opts.run_timeout, env=backend_env(b, opts))
        wall = time.monotonic() - t0
        res = parse_throughput(js, out) if rc == 0 else {}
        if rc == 0 and res.get("total_tok_s"):
            res.update(repeat=r, wall_s=wall, log=str(logp))
            runs[w.name][b].append(res)
            log(f"[e2e] {w.name:<14} {b:<10} r{r}: {res['total_tok_s']:9.1f} total tok/s, "
                f"{res.get('output_tok_s') or float('nan'):9.1f} output tok/s "
                f"(elapsed {res.get('elapsed_s') or float('nan'):.1f}s, wall {wall:.0f}s)")
        else:
            tail = "".join(out.splitlines(keepends=True)[-5:]).strip()
            errors[w.name][b] = f"run {r} failed (rc={rc}); see {logp}: {tail[-300:]}"
            log(f"[e2e] {w.name:<14} {b:<10} r{r}: FAILED rc={rc} (log {logp})")
        all_recs[w.name] = build_records(w, runs[w.name], opts, errors=errors[w.name])
        if on_records:
            on_records([x for v in all_recs.values() for x in v])
    return [x for v in all_recs.values() for x in v]


def run_serve(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
              log=print, on_records=None, prior: dict | None = None) -> list[dict]:
    """Per workload and backend: start ``vllm serve``, wait for /health, run
    ``vllm bench serve`` ``repeats`` times, stop the server."""
    all_recs: dict[str, list[dict]] = {}
    prior = prior or {}
    for w in workloads:
        runs = {b: list(prior.get(f"{w.name}-serve", {}).get(b, [])) for b in opts.backends}
        offset = min(len(v) for v in runs.values())
        runs = {b: v[:offset] for b, v in runs.items()}
        errors: dict[str, str] = {}
        for b in opts.backends:
            port = free_port()
            cmd = serve_cmd(w, b, opts, port)
            logp = out_dir / "logs" / f"{w.name}-serve-{b}.server.log"
            logp.parent.mkdir(parents=True, exist_ok=True)
            log(f"[e2e] starting vllm serve ({b}) on port {port} (log {logp})")
            env = dict(os.environ)
            env.update(backend_env(b, opts))
            with open(logp, "w") as lf:
                lf.write("$ " + " ".join(_q(c) for c in cmd) + "\n")
                lf.flush()
                proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=env)
                try:
                    wait_healthy(port, proc, opts.server_timeout)
                    for r in range(offset, offset + opts.repeats):
                        fname = f"{w.name}-serve-{b}-r{r}.json"
                        rdir = out_dir / "raw"
                        res_path = rdir / fname
                        if res_path.exists():
                            res_path.unlink()
                        bcmd = bench_serve_cmd(w, opts, port, str(rdir), fname)
                        blog = out_dir / "logs" / f"{w.name}-serve-{b}-r{r}.log"
                        rc, _ = _run_logged(bcmd, blog, opts.run_timeout, env=opts.env)
                        if rc == 0 and res_path.exists():
                            res = parse_bench_serve(res_path)
                            res.update(repeat=r, log=str(blog))
                            runs[b].append(res)
                            log(f"[e2e] {w.name + '-serve':<20} {b:<10} r{r}: "
                                f"{res['total_tok_s'] or float('nan'):9.1f} total tok/s, TTFT p50 "
                                f"{res['ttft_p50_ms'] or float('nan'):.1f} ms p99 "
                                f"{res['ttft_p99_ms'] or float('nan'):.1f} ms, TPOT p50 "
                                f"{res['tpot_p50_ms'] or float('nan'):.2f} ms p99 "
                                f"{res['tpot_p99_ms'] or float('nan'):.2f} ms")
                        else:
                            errors[b] = f"bench serve run {r} failed (rc={rc}); see {blog}"
                            log(f"[e2e] {w.name}-serve {b} r{r}: FAILED rc={rc} (log {blog})")
                except Exception as e:  # noqa: BLE001 - report and go on with the next side
                    errors[b] = f"{type(e).__name__}: {e} (server log {logp})"
                    log(f"[e2e] {w.name}-serve {b}: {errors[b]}")
                finally:
                    _kill_group(proc)
            all_recs[w.name] = build_records(w, runs, opts, case=f"{w.name}-serve",
                                             errors=errors)
            if on_records:
                on_records([x for v in all_recs.values() for x in v])
    return [x for v in all_recs.values() for x in v]


def select_workloads(names: list[str] | None) -> list[Workload]:
    if not names:
        return [WORKLOADS["seed"]]
    out = []
    for n in names:
        for part in n.split(","):
            part = part.strip()
            if not part:
                continue
            if part == "all":
                out.extend(WORKLOADS.values())
                continue
            if part not in WORKLOADS:
                raise KeyError(f"unknown workload {part!r}; choose from "
                               f"{', '.join(WORKLOADS)} or all")
            out.append(WORKLOADS[part])
    return list({w.name: w for w in out}.values())

