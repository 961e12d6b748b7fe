"""``ion-bench startup``: ``vllm serve`` time-to-ready (process start until GET /health
answers 200) per backend label, with the kernel caches cold and warm.

Per label, every cache lives under ``<cache_root>/<label>/``: ``VLLM_CACHE_ROOT`` (vLLM's
torch.compile cache), ``TRITON_CACHE_DIR``, ``CUTE_DSL_CACHE_DIR`` and ``ION_KERNEL_CACHE``
(ION's compiled kernels).  Start "prime" fills them; then, ``repeats`` times, label after
label: "cute-cold" (the two CuTeDSL kernel caches emptied first, vLLM's caches warm) and
"warm" (the kernel caches the cold start filled).  ``cold="all"`` skips the prime start and
runs "cold" (every cache of the label emptied: a first start on a fresh machine) before each
"warm" one.
Each server's process group is stopped once it is ready (or has failed).
"""

from __future__ import annotations

import shlex
import shutil
import statistics
import time
from pathlib import Path

from . import report
from .e2e import (BASELINE, VLLM_CLI, E2EOptions, Server, backend_env, free_port, fs_name,
                  kill_group, load_format_for, wait_healthy)

STATES = report.STARTUP_STATES


def cache_dirs(cache_root: Path, label: str) -> dict[str, Path]:
    d = Path(cache_root) / fs_name(label)
    return {"VLLM_CACHE_ROOT": d / "vllm", "TRITON_CACHE_DIR": d / "triton",
            "CUTE_DSL_CACHE_DIR": d / "cute", "ION_KERNEL_CACHE": d / "kernels"}

#: the caches a cute-cold start empties
KERNEL_CACHES = ("CUTE_DSL_CACHE_DIR", "ION_KERNEL_CACHE")


def plan_starts(labels, repeats: int, cold: str = "kernels") -> list[tuple[str, str, int]]:
    """(label, state, repeat) in start order.  ``cold="kernels"``: every label's prime start,
    then per repeat, label after label, its cute-cold start and the warm start after it;
    ``cold="all"``: per repeat, label after label, a cold start and a warm one."""
    if cold == "all":
        return [(b, s, r) for r in range(repeats) for b in labels for s in ("cold", "warm")]
    if cold != "kernels":
        raise ValueError(f"cold={cold!r}: use 'kernels' or 'all'")
    return ([(b, "prime", 0) for b in labels]
            + [(b, s, r) for r in range(repeats) for b in labels for s in ("cute-cold", "warm")])


def start_env(label: str, opts: E2EOptions, cache_root: Path) -> dict[str, str]:
    """Environment added to os.environ for a start of ``label`` (any state)."""
    return {**backend_env(label, opts), **{k: str(v) for k, v in cache_dirs(cache_root,
                                                                            label).items()}}


def serve_argv(label: str, opts: E2EOptions, port: int) -> list[str]:
    """``vllm serve MODEL`` for ``label``; ``opts.extra_args`` pass through (``--load-format
    dummy`` is added for a model dir without weights unless they set a load format)."""
    lf = [] if any(a.split("=")[0] == "--load-format" for a in opts.extra_args) else (
        ["--load-format", load_format_for(opts)] if load_format_for(opts) else [])
    return [opts.python, *VLLM_CLI, "serve", str(opts.model), "--host", "127.0.0.1",
            "--port", str(port), "--attention-backend", label.partition("@")[0], *lf,
            *opts.extra_args]


def measure_start(argv: list[str], env: dict, log_path: Path, port: int, timeout: float,
                  poll_s: float = 0.25) -> float:
    """Seconds from launch until GET /health is 200; the server's process group is stopped
    either way.  Raises if it exits or times out first."""
    s = Server("", port, argv, env, log_path)
    s.launch()
    try:
        wait_healthy(port, s.proc, timeout, poll_s)
        return time.monotonic() - s.started
    finally:
        kill_group(s.proc)


def build_records(runs: dict[tuple[str, str], list[dict]], labels) -> list[dict]:
    """One record per (state, label): its starts, the median time-to-ready of those that
    came up; the warm records of non-baseline labels carry ``ratio_vs_FLASH_ATTN``."""
    recs = []
    for state in STATES:
        for b in labels:
            rs = runs.get((state, b), [])
            if not rs and (state, b) not in runs and not any(k[0] == state for k in runs):
                continue  # a state this protocol does not run
            ok = [r["ready_s"] for r in rs if r.get("ready_s") is not None]
            rec = {"suite": "startup", "case": state, "backend": b, "runs": rs,
                   "median_s": statistics.median(ok) if ok else None,
                   "status": "ok" if ok else ("error" if rs else "skipped")}
            errs = [r["error"] for r in rs if r.get("error")]
            if errs:
                rec["error" if not ok else "warning"] = "; ".join(errs)
            recs.append(rec)
    for rec in recs:
        if rec["case"] == "warm" and rec["backend"] != BASELINE:
            ratio = report.startup_ratio(recs, rec["backend"])
            if ratio:
                rec[f"ratio_vs_{BASELINE}"] = ratio
    return recs


def run_startup(opts: E2EOptions, out_dir: Path, cache_root: Path, *, log=print,
                on_records=None, measure=measure_start, cold: str = "kernels") -> list[dict]:
    """Every start of :func:`plan_starts`; a start that fails is recorded and the rest go on."""
    runs: dict[tuple[str, str], list[dict]] = {}
    plan = plan_starts(opts.backends, opts.repeats, cold)
    for i, (b, state, r) in enumerate(plan):
        env = start_env(b, opts, cache_root)
        if state == "cold":
            shutil.rmtree(Path(cache_root) / fs_name(b), ignore_errors=True)
        for name in KERNEL_CACHES:
            if state == "cute-cold":
                shutil.rmtree(env[name], ignore_errors=True)
            Path(env[name]).mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = serve_argv(b, opts, port)
        log_path = out_dir / "logs" / f"startup-{fs_name(b)}-{state}-r{r}.server.log"
        log(f"[startup] ({i + 1}/{len(plan)}) {b} {state} repeat {r} ...")
        run = {"repeat": r, "log": str(log_path)}
        try:
            run["ready_s"] = measure(argv, env, log_path, port, opts.server_timeout)
            log(f"[startup] {b} {state} r{r}: ready after {run['ready_s']:.1f}s")
        except Exception as e:  # noqa: BLE001 - recorded; the other starts go on
            run["error"] = f"{type(e).__name__}: {e} (log {log_path})"
            log(f"[startup] {b} {state} r{r}: FAILED {run['error']}")
        runs.setdefault((state, b), []).append(run)
        if on_records:
            on_records(build_records(runs, opts.backends))
    return build_records(runs, opts.backends)


def print_plan(opts: E2EOptions, cache_root: Path, log=print, cold: str = "kernels") -> None:
    for b, state, r in plan_starts(opts.backends, opts.repeats, cold):
        env = start_env(b, opts, cache_root)
        clear = {"cute-cold": " (kernel caches emptied first)",
                 "cold": " (every cache emptied first)"}.get(state, "")
        log(f"# {b} {state} repeat {r}{clear}")
        log(" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + " "
            + shlex.join(serve_argv(b, opts, 8000)))
