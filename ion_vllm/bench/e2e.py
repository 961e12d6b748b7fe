"""End-to-end A/B through vLLM's own benchmarks: ``vllm bench throughput``, or ``vllm serve``
+ ``vllm bench serve`` (``--serve``; ``--colocate``: one server per backend, all on one
GPU at once).  Every side gets the same flags except ``--attention-backend``; repeats are
interleaved A/B/A/B.

A backend label is a vLLM ``--attention-backend`` name (``ION``, ``FLASH_ATTN``, ...), or
``NAME@DIR``: backend ``NAME`` with ``DIR`` first on the vLLM process's ``PYTHONPATH`` (and
``PYTHONSAFEPATH=1``, so the working directory does not shadow it), so that DIR's
``ion_vllm`` / ``cute_kernels`` are imported instead of the installed ones.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
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
BASELINE = report.E2E_BASELINE


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int            # --max-num-seqs / --max-concurrency
    num_prompts: int
    range_ratio: float | None = None   # random dataset: lengths uniform in [1-r, 1+r] x
    prefix_len: int = 0                # > 0: prefix_repetition dataset, prefix caching on
    num_prefixes: int = 0

    @property
    def dataset(self) -> str:
        return "prefix_repetition" if self.prefix_len else "random"

    @property
    def max_len(self) -> int:
        """The longest prompt + output the workload can draw."""
        r = 1 + (self.range_ratio or 0.0)
        return self.prefix_len + int(self.input_len * r) + math.ceil(self.output_len * r)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("seed", 7680, 512, 32, 64),                      # the anchor workload
    Workload("decode-heavy", 2048, 2048, 64, 64),
    Workload("long", 30720, 1024, 8, 16),
    Workload("skewed", 4096, 512, 64, 128, range_ratio=0.9),
    Workload("shared-prefix", 512, 512, 32, 64, prefix_len=6144, num_prefixes=4),
)}


@dataclass
class E2EOptions:
    model: str
    backends: tuple[str, ...] = ("ION", BASELINE)
    repeats: int = 2
    seed: int = 0
    num_prompts: int | None = None
    disable_detokenize: bool = False
    load_format: str | None = None       # None: "dummy" iff the model dir has no weights
    num_warmups: int = 4
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()     # passed to every vLLM engine (throughput / serve)
    python: str = sys.executable
    run_timeout: float = 1800.0
    server_timeout: float = 900.0
    env: dict = field(default_factory=dict)
    kv_cache_gib: float = 40.0           # --colocate: KV cache of each server
    time_budget: float = 0.0             # no new run after this many seconds (0: none)


# --------------------------------------------------------------------------- labels

def resolve_backend(label: str) -> tuple[str, str | None]:
    """(vLLM --attention-backend value, checkout dir to import from or None)."""
    name, _, path = label.partition("@")
    return name, (path or None)


def check_labels(labels) -> None:
    """Refuse duplicate labels and ``NAME@DIR`` whose DIR holds neither package."""
    if len(set(labels)) != len(labels) or not labels:
        raise ValueError(f"backends must be distinct and non-empty: {list(labels)}")
    for label in labels:
        name, path = resolve_backend(label)
        if not name or (path is not None and not any(
                (Path(path) / pkg / "__init__.py").is_file() for pkg in ("ion_vllm", "cute_kernels"))):
            raise ValueError(f"backend {label!r}: use NAME or NAME@DIR, DIR a checkout with "
                             "ion_vllm/ or cute_kernels/")


def backend_env(label: str, opts: E2EOptions, base: dict | None = None) -> dict[str, str]:
    """Environment variables added to ``base`` (default os.environ) for a process that runs
    backend ``label``."""
    env = dict(opts.env)
    path = resolve_backend(label)[1]
    if path:
        old = (os.environ if base is None else base).get("PYTHONPATH", "")
        env.update(PYTHONPATH=os.path.abspath(path) + (os.pathsep + old if old else ""),
                   PYTHONSAFEPATH="1")
    return env


def fs_name(label: str) -> str:
    """A label as a file-name part (``ION@/a/b`` -> ``ION@_a_b``)."""
    return re.sub(r"[^A-Za-z0-9@+.=-]", "_", label)


# --------------------------------------------------------------------------- commands

def load_format_for(opts: E2EOptions) -> str | None:
    if opts.load_format:
        return opts.load_format
    p = Path(opts.model)
    has = not p.is_dir() or any(f.name.endswith(WEIGHT_SUFFIXES) for f in p.iterdir())
    return None if has else "dummy"


def _dataset_args(w: Workload, opts: E2EOptions) -> list[str]:
    if w.dataset == "random":
        args = ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len)]
        if w.range_ratio is not None:
            args += ["--random-range-ratio", str(w.range_ratio)]
    else:
        args = ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(w.prefix_len),
                "--prefix-repetition-suffix-len", str(w.input_len),
                "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                "--prefix-repetition-output-len", str(w.output_len)]
    warm = max(opts.num_warmups, w.num_prefixes) if opts.num_warmups else 0  # >= 1 a prefix
    return (args + ["--num-prompts", str(opts.num_prompts or w.num_prompts)]
            + (["--num-warmups", str(warm)] if warm else []))


def _engine_args(label: str, workloads: list[Workload], opts: E2EOptions) -> list[str]:
    args = ["--attention-backend", resolve_backend(label)[0],
            "--max-num-seqs", str(max(w.concurrency for w in workloads)), "--seed", str(opts.seed)]
    if load_format_for(opts):
        args += ["--load-format", load_format_for(opts)]
    if any(w.prefix_len for w in workloads):
        args += ["--enable-prefix-caching"]
    if opts.max_model_len:
        args += ["--max-model-len", str(opts.max_model_len)]
    return args


def throughput_cmd(w: Workload, label: str, opts: E2EOptions, output_json) -> list[str]:
    """``vllm bench throughput`` for one side of the A/B."""
    return [opts.python, *VLLM_CLI, "bench", "throughput", "--backend", "vllm",
            "--model", str(opts.model), *_dataset_args(w, opts), *_engine_args(label, [w], opts),
            *(["--disable-detokenize"] if opts.disable_detokenize else []),
            "--output-json", str(output_json), *opts.extra_args]


#: GPU-memory fraction shared out between colocated servers
COLOCATE_GPU_PERCENT = 90


def colocate_gpu_memory_utilization(n_servers: int) -> float:
    """floor(0.90 / n, 2 decimals), in integer arithmetic (0.45 for two, 0.30 for three)."""
    if n_servers < 1:
        raise ValueError("need at least one server")
    return (COLOCATE_GPU_PERCENT // n_servers) / 100


def serve_cmd(label: str, workloads: list[Workload], opts: E2EOptions, port: int,
              colocated: int = 0) -> list[str]:
    """``vllm serve`` of ``label`` for ``workloads``; ``colocated`` = N > 0: one of N servers
    sharing the GPU (its memory fraction, a fixed KV cache, a max-model-len that fits every
    workload, rounded up to 256, unless --max-model-len is given)."""
    cmd = [opts.python, *VLLM_CLI, "serve", str(opts.model), "--host", "127.0.0.1",
           "--port", str(port), *_engine_args(label, workloads, opts)]
    if colocated:
        if opts.kv_cache_gib <= 0:
            raise ValueError(f"--kv-cache-gib must be > 0 (got {opts.kv_cache_gib})")
        cmd += ["--gpu-memory-utilization", f"{colocate_gpu_memory_utilization(colocated):.2f}",
                "--kv-cache-memory-bytes", str(round(opts.kv_cache_gib * (1 << 30)))]
        if not opts.max_model_len:
            cmd += ["--max-model-len", str(-(-max(w.max_len for w in workloads) // 256) * 256)]
    return cmd + list(opts.extra_args)


def bench_serve_cmd(w: Workload, opts: E2EOptions, port: int, result_path: Path,
                    seed: int) -> list[str]:
    """``vllm bench serve`` against the server on ``port``; each repeat takes its own
    ``seed`` (the same prompts again would be served from the prefix cache)."""
    return [opts.python, *VLLM_CLI, "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://127.0.0.1:{port}", "--model", str(opts.model),
            *_dataset_args(w, opts), "--max-concurrency", str(w.concurrency),
            "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(result_path.parent),
            "--result-filename", result_path.name]


def run_paths(out_dir: Path, w: Workload, label: str, r: int, serve: bool) -> tuple[Path, Path]:
    """(vLLM's result JSON, log) of one run."""
    stem = f"{w.name}{'-serve' if serve else ''}-{fs_name(label)}-r{r}"
    return out_dir / "raw" / f"{stem}.json", out_dir / "logs" / f"{stem}.log"


def plan_runs(workloads: list[Workload], labels, repeats: int,
              offsets: dict[str, int] | None = None) -> list[tuple[Workload, int, str]]:
    """(workload, repeat, label) in run order: per workload, repeat r runs every label in
    the given order (A/B/A/B); repeats start at ``offsets[workload]`` (kept runs)."""
    return [(w, r, b) for w in workloads
            for r in range((offsets or {}).get(w.name, 0),
                           (offsets or {}).get(w.name, 0) + repeats) for b in labels]


def server_groups(workloads: list[Workload], opts: E2EOptions, colocate: bool):
    """(workloads, labels) served together: all at once (colocated), else one server per
    (workload, label), in run order."""
    if colocate:
        return [(workloads, list(opts.backends))]
    return [([w], [b]) for w in workloads for b in opts.backends]


# --------------------------------------------------------------------------- results

_THROUGHPUT_RE = re.compile(r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,"
                            r"\s*([\d.]+)\s*output tokens/s")


def parse_throughput(json_path, stdout: str) -> dict:
    """One run's numbers from ``--output-json`` (elapsed, total tok/s) and the printed
    summary line (output tok/s, which the JSON does not carry)."""
    res: dict = {}
    if json_path and Path(json_path).exists():
        js = json.loads(Path(json_path).read_text())
        res = {"elapsed_s": js.get("elapsed_time"), "num_requests": js.get("num_requests"),
               "total_num_tokens": js.get("total_num_tokens"),
               "requests_s": js.get("requests_per_second"),
               "total_tok_s": js.get("tokens_per_second")}
    m = list(_THROUGHPUT_RE.finditer(stdout))
    if m:
        res.setdefault("requests_s", float(m[-1].group(1)))
        if res.get("total_tok_s") is None:
            res["total_tok_s"] = float(m[-1].group(2))
        res["output_tok_s"] = float(m[-1].group(3))
    return res


LATENCY_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms",
                "itl_p99_ms")


def parse_bench_serve(path) -> dict:
    js = json.loads(Path(path).read_text())
    out = {"total_tok_s": js.get("total_token_throughput"),
           "output_tok_s": js.get("output_throughput"),
           "requests_s": js.get("request_throughput"), "elapsed_s": js.get("duration"),
           "completed": js.get("completed"), "failed": js.get("failed")}
    for k in LATENCY_KEYS:
        m, p = k.split("_")[:2]
        out[k] = js.get(f"{p}_{m}_ms", js.get(f"median_{m}_ms") if p == "p50" else None)
    return out


def build_records(w: Workload, runs: dict[str, list[dict]], opts: E2EOptions, case: str,
                  errors: dict[str, list[str]], skipped: dict[str, list[int]]) -> list[dict]:
    """One record per label.  Means cover the repeats every label with runs finished (a run
    whose partner failed or was cut by the time budget is kept under ``unpaired_runs``); a
    label's record has ``ratio_<key>_vs_FLASH_ATTN`` when FLASH_ATTN ran."""
    present = [b for b in opts.backends if runs.get(b)]
    common = set.intersection(*({r["repeat"] for r in runs[b]} for b in present)) if present else set()
    recs = {}
    for b in opts.backends:
        paired = [r for r in runs.get(b, []) if r["repeat"] in common]
        unpaired = [r for r in runs.get(b, []) if r["repeat"] not in common]
        msgs = list(errors.get(b, []))
        if skipped.get(b):
            msgs.append(f"time budget {opts.time_budget:.0f}s spent: repeat(s) {skipped[b]} not run")
        if unpaired:
            msgs.append(f"repeat(s) {[r['repeat'] for r in unpaired]} kept out of the means "
                        "(no partner run)")
        rec = {"suite": "e2e", "case": case, "backend": b,
               "workload": {**w.__dict__, "dataset": w.dataset, "model": str(opts.model),
                            "seed": opts.seed, "num_prompts": opts.num_prompts or w.num_prompts,
                            "load_format": load_format_for(opts)},
               "runs": paired, **report.e2e_aggregate(paired)}
        rec.update({k: sum(v) / len(v) for k in LATENCY_KEYS
                    if (v := [r[k] for r in paired if r.get(k) is not None])})
        if unpaired:
            rec["unpaired_runs"] = unpaired
        if paired:
            rec.update(status="ok", **({"warning": "; ".join(msgs)} if msgs else {}))
        else:
            rec.update(status="skipped" if skipped.get(b) and not errors.get(b) else "error",
                       error="; ".join(msgs) or "no successful run")
        recs[b] = rec
    base = recs.get(BASELINE)
    for b, rec in recs.items():
        for key in ("total_tok_s", "output_tok_s"):
            r = report.e2e_ratio(rec, base, key) if base and b != BASELINE else None
            if r:
                rec[f"ratio_{key}_vs_{BASELINE}"] = r
    return list(recs.values())


# --------------------------------------------------------------------------- processes

def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None
               ) -> tuple[int, str]:
    """Run ``cmd`` in its own session, its output into ``log_path``; on timeout or interrupt
    the whole process group (vLLM's engine core included) is killed.  Returns (exit code,
    -9 on timeout; the log's text)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            rc = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            kill_group(proc)
            if isinstance(e, KeyboardInterrupt):
                raise
            rc = -9
    return rc, log_path.read_text(errors="replace")


def _group_pids(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (Linux /proc; zombies, which hold no
    GPU memory and wait for a parent or init to reap them, do not count)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            pids.append(int(pid))
    return pids


def _ignores(pid: int, sig: int) -> bool:
    """Whether process ``pid`` ignores ``sig`` (Linux; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return bool(next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigIgn:"))
                        >> (sig - 1) & 1)
    except (OSError, StopIteration, ValueError, IndexError):
        return False


def kill_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop the process group led by ``proc`` (started with its own session): SIGINT, then
    SIGTERM, then SIGKILL, until no process of the group runs (vLLM's engine core holds the
    GPU until it exits, and the next server may be about to start).  A group whose every
    process ignores SIGINT (as a background job's children do) gets SIGTERM at once."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, max(1.0, grace / 2)),
                      (signal.SIGKILL, 5.0)):
        pids = _group_pids(proc.pid)
        if sig == signal.SIGINT and pids and all(_ignores(p, sig) for p in pids):
            continue
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader
            if not _group_pids(proc.pid):
                return
            time.sleep(0.05)
    proc.poll()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEALTH_POLL_S = 2.0


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float,
                 poll_s: float | None = None) -> None:
    """Return once GET /health answers 200; raise if ``proc`` exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(HEALTH_POLL_S if poll_s is None else poll_s)
    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s")


@dataclass
class Server:
    label: str
    port: int
    argv: list[str]
    env: dict[str, str]           # added to os.environ
    log_path: Path
    proc: subprocess.Popen | None = None
    started: float | None = None  # time.monotonic() just before the launch
    startup_s: float | None = None
    error: str | None = None

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as f:
            f.write("$ " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
                    + " " + shlex.join(self.argv) + "\n")
            f.flush()
            self.started = time.monotonic()
            self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **self.env})

    def wait(self, timeout: float) -> None:
        try:
            wait_healthy(self.port, self.proc, timeout)
            self.startup_s = time.monotonic() - self.started
        except Exception as e:  # noqa: BLE001 - recorded; the others go on
            self.error = f"{type(e).__name__}: {e} (server log {self.log_path})"

    def info(self, colocated: bool) -> dict:
        return {"colocated": colocated, "startup_s": self.startup_s, "port": self.port,
                "argv": self.argv, **({"error": self.error} if self.error else {})}


def start_servers(servers: list[Server], timeout: float, log) -> None:
    """Launch every server, then wait for all of them at once; a server that cannot start,
    dies or times out gets ``error``, the others ``startup_s``."""
    for s in servers:
        log(f"[e2e] starting vllm serve ({s.label}) on port {s.port} (log {s.log_path})")
        try:
            s.launch()
        except OSError as e:
            s.error = f"could not start vllm serve: {type(e).__name__}: {e}"
    threads = [threading.Thread(target=s.wait, args=(timeout,), daemon=True)
               for s in servers if s.proc]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    for s in servers:
        log(f"[e2e] server {s.label}: " + (f"FAILED: {s.error}" if s.error
                                            else f"healthy after {s.startup_s:.0f}s"))


def stop_servers(servers: list[Server]) -> None:
    """Stop every server's process group, all at once."""
    threads = [threading.Thread(target=kill_group, args=(s.proc,), daemon=True)
               for s in servers if s.proc]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def reset_prefix_cache(port: int, tries: int = 3) -> bool | None:
    """POST /reset_prefix_cache (served under VLLM_SERVER_DEV_MODE=1), so that a bench run
    never hits blocks an earlier workload or repeat cached.  None: no such route."""
    for i in range(tries):
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache",
                                         data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
            try:
                if json.loads(body or b"{}").get("success", True):  # it refuses while
                    return True                                     # blocks are in use
            except (ValueError, AttributeError):
                return True  # 200 without a JSON verdict
        except urllib.error.HTTPError as e:
            if e.code in (404, 405):
                return None
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0 if i + 1 < tries else 0)
    return False


# --------------------------------------------------------------------------- colocate sizing

#: GiB per colocated server that is neither weights nor KV cache (CUDA context,
#: activations, CUDA-graph pools, torch.compile workspaces)
COLOCATE_RESERVE_GIB = 3.0


def estimate_weight_bytes(model, dtype_bytes: int = 2) -> int | None:
    """Weight bytes of a dense decoder from its ``config.json``, or None (missing config,
    MoE): Qwen2.5-7B gives 7.62e9 parameters."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        h, inter, vocab = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["vocab_size"])
        nh = int(c["num_attention_heads"])
        nkv, d = int(c.get("num_key_value_heads") or nh), int(c.get("head_dim") or h // nh)
        layers = int(c["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(k in c for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    per_layer = 2 * h * nh * d + 2 * h * nkv * d + 3 * h * inter
    return dtype_bytes * (layers * per_layer + vocab * h * (1 if c.get("tie_word_embeddings") else 2))


def gpu_total_bytes() -> int | None:
    """GPU 0's memory from ``nvidia-smi`` (no CUDA context in this process), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_colocated_memory(n: int, kv_gib: float, weight_bytes: int | None,
                           total_bytes: int | None) -> None:
    """Refuse colocated servers that cannot all fit (each: its fixed KV cache, weights and
    ``COLOCATE_RESERVE_GIB``; overcommitted, one dies mid-benchmark).  Unknown: no check."""
    if weight_bytes is None or total_bytes is None:
        return
    gib = 1 << 30
    need = n * (kv_gib * gib + weight_bytes + COLOCATE_RESERVE_GIB * gib)
    if need > total_bytes:
        fit = total_bytes / n / gib - weight_bytes / gib - COLOCATE_RESERVE_GIB
        hint = (f"use --kv-cache-gib {math.floor(fit * 10) / 10:g} or fewer backends"
                if fit >= 0.1 else "the weights and reserve alone do not fit")
        raise ValueError(f"--colocate: {n} servers need {need / gib:.1f} GiB > the GPU's "
                         f"{total_bytes / gib:.1f} GiB; {hint}")


# --------------------------------------------------------------------------- drivers

def ensure_model(opts: E2EOptions, log=print) -> None:
    """The default demo model dir is made on first use by ``scripts/make_demo_model.py``."""
    p = Path(opts.model)
    if p.exists():
        return
    if p == DEFAULT_MODEL_DIR and DEMO_MODEL_SCRIPT.exists():
        log(f"[e2e] creating demo model in {p} with {DEMO_MODEL_SCRIPT}")
        subprocess.run([opts.python, str(DEMO_MODEL_SCRIPT), str(p)], check=True)
        return
    raise FileNotFoundError(f"model dir {p} does not exist "
                            f"(create one with: python3 {DEMO_MODEL_SCRIPT} {p})")


class _Book:
    """Runs, errors and budget skips per (case, label), and the records built from them."""

    def __init__(self, workloads, opts, prior, suffix, clock, t_start):
        self.opts, self.suffix, self.clock = opts, suffix, clock
        self.t_start = clock() if t_start is None else t_start
        self.w = {w.name: w for w in workloads}
        self.runs = {w.name: {b: list((prior or {}).get(w.name + suffix, {}).get(b, []))
                              for b in opts.backends} for w in workloads}
        self.offsets = {n: 1 + max((r.get("repeat", -1) for v in rs.values() for r in v),
                                   default=-1) for n, rs in self.runs.items()}
        self.errors = {n: {} for n in self.w}
        self.skipped = {n: {} for n in self.w}
        self.extra: dict[tuple, dict] = {}   # (workload, label) -> fields of its record

    def over_budget(self) -> bool:
        b = self.opts.time_budget
        return b > 0 and self.clock() - self.t_start >= b

    def error(self, w: str, label: str, msg: str) -> None:
        self.errors[w].setdefault(label, []).append(msg)

    def records(self) -> list[dict]:
        out = []
        for n, w in self.w.items():
            for rec in build_records(w, self.runs[n], self.opts, n + self.suffix,
                                     self.errors[n], self.skipped[n]):
                out.append({**rec, **self.extra.get((n, rec["backend"]), {})})
        return out


def run_throughput(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *, log=print,
                   on_records=None, prior=None, t_start=None, clock=time.monotonic) -> list[dict]:
    """Every (workload, repeat, label) of :func:`plan_runs` as one ``vllm bench throughput``
    process.  ``prior[case][label]``: runs kept from earlier calls (``--accumulate``)."""
    book = _Book(workloads, opts, prior, "", clock, t_start)
    plan = plan_runs(workloads, opts.backends, opts.repeats, book.offsets)
    for i, (w, r, b) in enumerate(plan):
        if book.over_budget():
            book.skipped[w.name].setdefault(b, []).append(r)
            continue
        js, logp = run_paths(out_dir, w, b, r, serve=False)
        log(f"[e2e] ({i + 1}/{len(plan)}) {w.name} {b} repeat {r} ...")
        js.parent.mkdir(parents=True, exist_ok=True)
        js.unlink(missing_ok=True)
        t0 = time.monotonic()
        rc, out = run_logged(throughput_cmd(w, b, opts, js), logp, opts.run_timeout,
                             env=backend_env(b, opts))
        res = parse_throughput(js, out) if rc == 0 else {}
        if res.get("total_tok_s"):
            book.runs[w.name][b].append(dict(res, repeat=r, wall_s=time.monotonic() - t0,
                                             log=str(logp)))
            log(f"[e2e] {w.name} {b} r{r}: {res['total_tok_s']:.1f} total tok/s, "
                f"{res.get('output_tok_s') or float('nan'):.1f} output tok/s")
        else:
            book.error(w.name, b, f"run {r} failed (rc={rc}); see {logp}: "
                                  + out.strip()[-300:].replace("\n", " | "))
            log(f"[e2e] {w.name} {b} r{r}: FAILED rc={rc} (log {logp})")
        if on_records:
            on_records(book.records())
    return book.records()


def run_serve(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
              colocate: bool = False, log=print, on_records=None, prior=None, t_start=None,
              clock=time.monotonic) -> list[dict]:
    """``vllm bench serve`` against ``vllm serve``: per (workload, label) its own server, or
    (``colocate``) one server per label for every workload, all started at once on one GPU.
    Per workload and repeat r, every label in turn (A/B/A/B) runs with seed ``seed + r``
    after a prefix-cache reset.  Servers are always stopped (process groups)."""
    book = _Book(workloads, opts, prior, "-serve", clock, t_start)
    for g_workloads, labels in server_groups(workloads, opts, colocate):
        if book.over_budget():
            for w, r, b in plan_runs(g_workloads, labels, opts.repeats, book.offsets):
                book.skipped[w.name].setdefault(b, []).append(r)
            continue
        ports: list[int] = []
        while len(ports) < len(labels):
            p = free_port()
            ports += [] if p in ports else [p]
        ports = dict(zip(labels, ports))
        tag = "colocated" if colocate else g_workloads[0].name
        servers = {b: Server(b, ports[b], serve_cmd(b, g_workloads, opts, ports[b],
                                                    len(labels) if colocate else 0),
                             {"VLLM_SERVER_DEV_MODE": "1", **backend_env(b, opts)},
                             out_dir / "logs" / f"{tag}-{fs_name(b)}.server.log")
                   for b in labels}
        try:
            wait_s = opts.server_timeout
            if opts.time_budget > 0:
                wait_s = min(wait_s, max(0.0, opts.time_budget - (clock() - book.t_start)))
            start_servers(list(servers.values()), wait_s, log)
            for b, s in servers.items():
                if s.error and wait_s < opts.server_timeout:
                    s.error += f" (wait capped by the {opts.time_budget:.0f}s time budget)"
                for w in g_workloads:
                    book.extra[w.name, b] = {"server": s.info(colocate)}
            _serve_runs(book, g_workloads, servers, opts, out_dir, log, on_records)
        finally:
            stop_servers(list(servers.values()))
    return book.records()


def _serve_runs(book: _Book, workloads, servers: dict[str, Server], opts, out_dir, log,
                on_records) -> None:
    for w, r, b in plan_runs(workloads, list(servers), opts.repeats, book.offsets):
        s = servers[b]
        if s.error is None and s.proc.poll() is not None:
            s.error = f"server exited with code {s.proc.returncode} during the benchmark " \
                      f"(server log {s.log_path})"
        if s.error:
            msg = f"server failed: {s.error}"
            if msg not in book.errors[w.name].get(b, []):
                book.error(w.name, b, msg)
            continue
        if book.over_budget():
            book.skipped[w.name].setdefault(b, []).append(r)
            continue
        reset = reset_prefix_cache(s.port)
        res_path, blog = run_paths(out_dir, w, b, r, serve=True)
        res_path.parent.mkdir(parents=True, exist_ok=True)
        res_path.unlink(missing_ok=True)
        log(f"[e2e] {w.name}-serve {b} repeat {r} (seed {opts.seed + r}, port {s.port}) ...")
        t0 = time.monotonic()
        rc, _ = run_logged(bench_serve_cmd(w, opts, s.port, res_path, opts.seed + r), blog,
                           opts.run_timeout, env=opts.env)
        if rc == 0 and res_path.exists():
            res = dict(parse_bench_serve(res_path), repeat=r, seed=opts.seed + r,
                       wall_s=time.monotonic() - t0, log=str(blog), prefix_cache_reset=reset)
            book.runs[w.name][b].append(res)
            log(f"[e2e] {w.name}-serve {b} r{r}: {res['total_tok_s'] or float('nan'):.1f} "
                f"total tok/s, TTFT p50 {res['ttft_p50_ms'] or float('nan'):.1f} ms, "
                f"TPOT p50 {res['tpot_p50_ms'] or float('nan'):.2f} ms")
        else:
            book.error(w.name, b, f"bench serve run {r} failed (rc={rc}); see {blog}")
            log(f"[e2e] {w.name}-serve {b} r{r}: FAILED rc={rc} (log {blog})")
        if on_records:
            on_records(book.records())


def select_workloads(names: list[str] | None) -> list[Workload]:
    out = []
    for part in (p.strip() for n in (names or ["seed"]) for p in n.split(",")):
        if part == "all":
            out += WORKLOADS.values()
        elif part:
            if part not in WORKLOADS:
                raise KeyError(f"unknown workload {part!r}; choose from "
                               f"{', '.join(WORKLOADS)} or all")
            out.append(WORKLOADS[part])
    return list({w.name: w for w in out}.values())
