"""``ion-bench``: A/B benchmarks of ION against vLLM's stock attention.

    ion-bench kernel  [--suite NAME ...] [--case NAME ...] [--backends ion,ion-attn,fa3,...]
    ion-bench e2e     [--workload NAME ...] [--backends ION,ION@DIR,FLASH_ATTN] [--serve]
                      [--colocate] [--repeats 2]
    ion-bench startup [--backends ION,FLASH_ATTN] [--repeats 1] [vllm serve args ...]
    ion-bench report  DIR

Results go to bench/results/<date>-<gpu>/ (--out overrides): summary.json, table.md,
plot.png, logs/, raw/.  See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import e2e as e2e_mod
from . import kernel_runner, kernel_suite, report


def _log(msg: str) -> None:
    print(msg, flush=True)


def _csv(items) -> list[str]:
    items = [items] if isinstance(items, str) else items
    return [x.strip() for s in items for x in s.split(",") if x.strip()]


def versions() -> dict:
    out = {}
    for dist in ("torch", "vllm", "nvidia-cutlass-dsl", "triton", "ion-vllm"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def gpu_name_via_subprocess(python: str = sys.executable) -> str:
    """GPU name without a CUDA context in this process (vLLM needs the whole GPU)."""
    for cmd in ([python, "-c", "import torch; print(torch.cuda.get_device_name())"],
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown-gpu"


def _meta(gpu: str) -> dict:
    return {"gpu": gpu, "date": _dt.date.today().isoformat(), "versions": versions()}


def _results_dir(args, gpu: str) -> Path:
    """The results dir; the command line that writes into it is appended to commands.txt."""
    out = Path(args.out) if args.out else report.default_results_dir(gpu)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:
        f.write(f"{_dt.datetime.now().isoformat(timespec='seconds')} "
                f"{shlex.join(['ion-bench', *args.argv])}\n")
    return out


# --------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ion-bench", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    k = sub.add_parser("kernel", help="one attention call per case: CUDA events, KV rotated "
                                      "past L2, checked against the fp32 reference")
    k.add_argument("--suite", action="append", choices=list(kernel_suite.SUITES),
                   help="shape suite (repeatable); default smoke when no --case")
    k.add_argument("--case", action="append", default=[],
                   help="case name (repeatable, comma-separated); see --list")
    k.add_argument("--backends", default="ion,ion-attn,fa3",
                   help="comma-separated names of kernel_runner.BACKENDS: "
                        + ", ".join(kernel_runner.BACKENDS))
    k.add_argument("--register", action="append", default=[], metavar="FILE.py",
                   help="run this Python file first; it may add backends to "
                        "ion_vllm.bench.kernel_runner.BACKENDS (repeatable)")
    k.add_argument("--iters", type=int, default=60, help="timed calls per case and backend")
    k.add_argument("--warmup", type=int, default=10)
    k.add_argument("--timing", choices=kernel_runner.TIMINGS, default="interleaved",
                   help="interleaved: a case's backends alternate call by call in one "
                        "stream; queued: one backend after the other")
    k.add_argument("--no-ceilings", action="store_true",
                   help="skip the copy/GEMM ceiling measurement (reuse the dir's)")
    k.add_argument("--device", default="cuda")
    k.add_argument("--list", action="store_true", help="print the selected cases and exit")
    k.add_argument("--out", help="results dir (default bench/results/<date>-<gpu>)")

    e = sub.add_parser("e2e", help="whole-model A/B through vLLM's bench throughput / serve")
    e.add_argument("--workload", action="append", default=[],
                   help=f"repeatable / comma-separated: {', '.join(e2e_mod.WORKLOADS)}, all "
                        "(default seed)")
    _backends(e)
    e.add_argument("--repeats", type=int, default=2, help="interleaved A/B/A/B repeats")
    e.add_argument("--num-prompts", type=int, help="override the workload's prompt count")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--serve", action="store_true",
                   help="vllm serve + vllm bench serve (TTFT/TPOT p50/p99) instead of "
                        "bench throughput; one server per workload and backend")
    e.add_argument("--colocate", action="store_true",
                   help="implies --serve: one server per backend for every workload, all "
                        "started at once on the GPU (--gpu-memory-utilization 0.90/N)")
    e.add_argument("--kv-cache-gib", type=float, default=40.0,
                   help="--colocate: each server's KV cache (--kv-cache-memory-bytes)")
    e.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                   help="start no run after this many seconds (0: none); what was not run "
                        "is recorded as skipped")
    e.add_argument("--disable-detokenize", action="store_true")
    e.add_argument("--num-warmups", type=int, default=4)
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--load-format", help="default: dummy when the model dir has no weights")
    e.add_argument("--vllm-arg", action="append", default=[],
                   help="extra engine argument for every side (repeatable; --vllm-arg=--flag)")
    e.add_argument("--run-timeout", type=float, default=1800.0)
    e.add_argument("--accumulate", action="store_true",
                   help="add this call's repeats to the runs already in summary.json")
    e.add_argument("--dry-run", action="store_true", help="print the vLLM commands and exit")

    s = sub.add_parser(
        "startup", allow_abbrev=False,
        help="vllm serve time-to-ready per backend, kernel caches cold and warm",
        description="Time from `vllm serve MODEL` start until GET /health is 200, per backend: "
                    "a first start fills vLLM's caches, then --repeats times a start with the "
                    "CuTeDSL cache emptied (cute-cold) and one with the cache it filled (warm). "
                    "Arguments ion-bench does not know go to vllm serve.",
        epilog="e.g. ion-bench startup --repeats 2 --max-model-len 8192")
    _backends(s)
    s.add_argument("--repeats", type=int, default=1, help="cold + warm starts per backend")
    s.add_argument("--cold", choices=("kernels", "all"), default="kernels",
                   help="kernels: a prime start fills vLLM's caches, cold starts empty only the "
                        "kernel caches; all: no prime start, cold starts empty every cache")
    s.add_argument("--cache-root", help="where the caches of every start live (default: a "
                                        "temporary dir, removed at the end)")
    s.add_argument("--server-timeout", type=float, default=900.0)
    s.add_argument("--dry-run", action="store_true", help="print the starts and exit")

    r = sub.add_parser("report", help="re-render table.md and plot.png from summary.json")
    r.add_argument("dir")
    return p


def _backends(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="ION,FLASH_ATTN",
                   help="comma-separated, in run order: vLLM --attention-backend names, or "
                        "NAME@DIR (DIR's ion_vllm / cute_kernels imported first)")
    p.add_argument("--model", default=str(e2e_mod.DEFAULT_MODEL_DIR),
                   help="local model dir (default: the demo model, made on first use)")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs vLLM")
    p.add_argument("--out", help="results dir (default bench/results/<date>-<gpu>)")


# --------------------------------------------------------------------------- kernel

def cmd_kernel(args) -> int:
    for path in args.register:
        runpy.run_path(path, run_name="ion_bench_register")
    try:
        cases = kernel_suite.select(args.suite, _csv(args.case))
    except KeyError as err:
        _log(f"ion-bench: {err.args[0]}")
        return 2
    backends = _csv(args.backends)
    bad = [b for b in backends if b not in kernel_runner.BACKENDS]
    if bad or not backends:
        _log(f"ion-bench: unknown kernel backend(s) {bad}; known: "
             f"{', '.join(kernel_runner.BACKENDS)}")
        return 2
    if args.list:
        for c in cases:
            _log(f"{c.name:<46} B={c.batch:<4} total_q={c.total_q:<6} total_kv={c.total_kv:<8} "
                 f"bytes={kernel_suite.min_bytes(c):>12} flops={kernel_suite.flops(c):>15} "
                 f"rot={kernel_suite.rotations(c)}")
        return 0
    import torch
    if not torch.cuda.is_available():
        _log("ion-bench kernel: no CUDA device")
        return 2
    gpu = torch.cuda.get_device_name(torch.device(args.device))
    out = _results_dir(args, gpu)
    _log(f"[kernel] {len(cases)} case(s) x {backends} on {gpu}; results -> {out}")
    ceil = _meta(gpu)
    if args.no_ceilings:
        old = report.load_summary(out)["ceilings"]
        ceil.update({k: old[k] for k in ("copy_gbps", "gemm_tflops") if old.get(k)})
    else:
        ceil.update(kernel_runner.measure_ceilings(torch.device(args.device)))
        _log(f"[kernel] ceilings: copy {ceil['copy_gbps']:.0f} GB/s, "
             f"bf16 GEMM {ceil['gemm_tflops']:.0f} TFLOP/s")
    report.update_summary(out, [], ceil)
    recs = kernel_runner.run_kernel_suite(
        cases, backends, iters=args.iters, warmup=args.warmup, device=args.device,
        ceilings=ceil, suite_label=",".join(args.suite or []) or "cases", log=_log,
        on_record=lambda rs: report.update_summary(out, rs), timing=args.timing)
    report.update_summary(out, recs)
    table, plot = report.render(out)
    _log(f"[kernel] wrote {out / 'summary.json'}, {table}, {plot}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in recs) else 1


# --------------------------------------------------------------------------- e2e

def _opts(args, **kw) -> e2e_mod.E2EOptions:
    return e2e_mod.E2EOptions(model=args.model, backends=tuple(_csv(args.backends)),
                              repeats=args.repeats, python=args.python, **kw)


def _dry_run_e2e(workloads, opts, args, out: Path) -> None:
    if not args.serve:
        for w, r, b in e2e_mod.plan_runs(workloads, opts.backends, opts.repeats):
            _log(f"# {w.name} / {b} / repeat {r}" + _env_note(b, opts))
            js = e2e_mod.run_paths(out, w, b, r, serve=False)[0]
            _log(shlex.join(e2e_mod.throughput_cmd(w, b, opts, js)))
        return
    for ws, labels in e2e_mod.server_groups(workloads, opts, args.colocate):
        for i, b in enumerate(labels):
            _log(f"# server {b} for {', '.join(w.name for w in ws)}" + _env_note(b, opts))
            _log(shlex.join(e2e_mod.serve_cmd(b, ws, opts, 8000 + i,
                                              len(labels) if args.colocate else 0)))
        for w, r, b in e2e_mod.plan_runs(ws, labels, opts.repeats):
            _log(f"# {w.name} / {b} / repeat {r} (prefix cache reset first)")
            js = e2e_mod.run_paths(out, w, b, r, serve=True)[0]
            _log(shlex.join(e2e_mod.bench_serve_cmd(w, opts, 8000 + labels.index(b), js,
                                                    opts.seed + r)))


def _env_note(label: str, opts) -> str:
    env = e2e_mod.backend_env(label, opts, base={})
    return f" (environment: {' '.join(f'{k}={v}' for k, v in env.items())})" if env else ""


def cmd_e2e(args) -> int:
    t_start = time.monotonic()
    args.serve = args.serve or args.colocate
    try:
        workloads = e2e_mod.select_workloads(args.workload)
        if args.repeats < 1 or args.time_budget < 0 or args.kv_cache_gib <= 0:
            raise ValueError("--repeats must be >= 1, --time-budget >= 0, --kv-cache-gib > 0")
        opts = _opts(args, seed=args.seed, num_prompts=args.num_prompts,
                     disable_detokenize=args.disable_detokenize, load_format=args.load_format,
                     num_warmups=args.num_warmups, max_model_len=args.max_model_len,
                     extra_args=tuple(args.vllm_arg), run_timeout=args.run_timeout,
                     kv_cache_gib=args.kv_cache_gib, time_budget=args.time_budget)
        e2e_mod.check_labels(opts.backends)
        if args.dry_run:
            _dry_run_e2e(workloads, opts, args, Path(args.out or "bench/results/<date>-<gpu>"))
            return 0
        e2e_mod.ensure_model(opts, log=_log)
        if args.colocate:
            e2e_mod.check_colocated_memory(len(opts.backends), opts.kv_cache_gib,
                                           e2e_mod.estimate_weight_bytes(opts.model),
                                           e2e_mod.gpu_total_bytes())
    except (KeyError, ValueError, FileNotFoundError, subprocess.CalledProcessError) as err:
        _log(f"ion-bench: {err.args[0] if isinstance(err, KeyError) else err}")
        return 2
    gpu = gpu_name_via_subprocess(opts.python)
    out = _results_dir(args, gpu)
    mode = "colocated serve" if args.colocate else "serve" if args.serve else "throughput"
    _log(f"[e2e] {[w.name for w in workloads]} x {list(opts.backends)} x {opts.repeats} "
         f"repeats ({mode}); results -> {out}")
    report.update_summary(out, [], _meta(gpu))
    prior: dict = {}
    if args.accumulate:
        for rec in report.load_summary(out)["records"]:
            if rec.get("suite") == "e2e":
                prior.setdefault(rec["case"], {})[rec["backend"]] = (
                    rec.get("runs", []) + rec.get("unpaired_runs", []))

    def flush(records):  # after every run: a command killed at its time limit keeps them
        report.update_summary(out, records)
        report.render(out, plot=False)
    kw = dict(log=_log, on_records=flush, prior=prior, t_start=t_start)
    recs = (e2e_mod.run_serve(workloads, opts, out, colocate=args.colocate, **kw) if args.serve
            else e2e_mod.run_throughput(workloads, opts, out, **kw))
    report.update_summary(out, recs)
    report.render(out)
    for rec in recs:
        rat = rec.get(f"ratio_total_tok_s_vs_{e2e_mod.BASELINE}")
        if rat:
            _log(f"[e2e] {rec['case']}: {rec['backend']}/{e2e_mod.BASELINE} total tok/s = "
                 f"{rat['ratio']:.3f} (per-repeat {rat['ratio_min']:.3f}..{rat['ratio_max']:.3f})")
    _log(f"[e2e] wrote {out / 'summary.json'}, table.md, plot.png")
    return 1 if any(r["status"] not in ("ok", "skipped") for r in recs) else 0


# --------------------------------------------------------------------------- startup

def cmd_startup(args, extra: list[str]) -> int:
    from . import startup
    opts = _opts(args, extra_args=tuple(extra), server_timeout=args.server_timeout)
    try:
        if args.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        e2e_mod.check_labels(opts.backends)
        if args.dry_run:
            startup.print_plan(opts, Path(args.cache_root or "<cache-root>"), log=_log,
                               cold=args.cold)
            return 0
        e2e_mod.ensure_model(opts, log=_log)
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as err:
        _log(f"ion-bench: {err}")
        return 2
    gpu = gpu_name_via_subprocess(opts.python)
    out = _results_dir(args, gpu)
    report.update_summary(out, [], _meta(gpu))
    with tempfile.TemporaryDirectory(prefix="ion-startup-") as tmp:
        root = Path(args.cache_root or tmp)
        _log(f"[startup] {list(opts.backends)} x {opts.repeats} repeat(s); caches in {root}; "
             f"results -> {out}")
        recs = startup.run_startup(opts, out, root, log=_log, cold=args.cold,
                                   on_records=lambda rs: report.update_summary(out, rs))
    report.update_summary(out, recs)
    table, _ = report.render(out)
    _log(report.render_table({"records": recs}))
    _log(f"[startup] wrote {out / 'summary.json'}, {table}")
    return 0 if all(r["status"] == "ok" for r in recs) else 1


# --------------------------------------------------------------------------- main

def cmd_report(args) -> int:
    d = Path(args.dir)
    if not (d / "summary.json").exists():
        _log(f"ion-bench: no summary.json in {d}")
        return 2
    table, plot = report.render(d)
    _log(f"wrote {table}" + (f" and {plot}" if plot else " (nothing to plot)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, extra = p.parse_known_args(argv)
    args.argv = argv
    if args.cmd == "startup":
        return cmd_startup(args, extra)
    if extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return {"kernel": cmd_kernel, "e2e": cmd_e2e, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
