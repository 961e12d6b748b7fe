"""``ion-bench``: A/B benchmarks of ION against vLLM's stock attention.

    ion-bench kernel [--suite NAME ...] [--case NAME ...] [--backends ion,ion-unpacked,fa3,fa4,triton]
    ion-bench e2e    [--workload NAME ...] [--backends ION,FLASH_ATTN] [--repeats 2] [--serve]
                     [--colocate [--kv-cache-gib 40] [--time-budget S]]
    ion-bench report DIR

Results go to ``bench/results/<date>-<gpu>/`` (``--out`` overrides): summary.json,
table.md, plot.png.  See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import e2e as e2e_mod
from . import kernel_suite, report


def _log(msg: str) -> None:
    print(msg, flush=True)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def versions() -> dict:
    out = {}
    for dist in ("torch", "vllm", "nvidia-cutlass-dsl", "triton", "ion-vllm"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        import torch
        out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return out


def gpu_name_via_subprocess(python: str = sys.executable) -> str:
    """GPU name without creating a CUDA context in this process (e2e runs need
    the whole GPU for vLLM)."""
    try:
        r = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name())"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        pass
    return "unknown-gpu"


# --------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ion-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    k = sub.add_parser("kernel", help="kernel-level A/B (CUDA events, rotating KV buffers)")
    k.add_argument("--suite", action="append", choices=kernel_suite.SUITES,
                   help="named shape suite (repeatable); default smoke when no --case")
    k.add_argument("--case", action="append", default=[],
                   help="case name (repeatable; comma-separated allowed); see --list")
    k.add_argument("--backends", default="ion,fa3,fa4,triton",
                   help="comma-separated subset of ion,ion-auto,ion-auto-rc,ion-auto-gc,"
                        "ion-auto-p128,ion-auto-lr,ion-auto-pdl,ion-auto-lc,ion-auto-kp,"
                        "ion-auto-append,ion-auto-fused-kp,ion-auto-s2,ion-auto-fused-s2,"
                        "ion-auto-fused-wf,ion-auto-pp,ion-auto-fused-pp,ion-auto-np,"
                        "ion-auto-fused-np,ion-auto-pin,ion-auto-fused-pin,"
                        "ion-auto-c3,ion-auto-fused-c3,"
                        "ion-auto-fused,ion-unpacked,ion-m128,ion-m128-unpacked,"
                        "fa3,fa3-layer,fa4,triton "
                        "(-p128: over 128-token pages, an experiment; -lr: lazy-rescaling "
                        "kernels, an experiment; -pdl: the combine by programmatic dependent "
                        "launch; -lc: the split-parallel combine, part of the default; "
                        "-kp: two pages per K/V stage on 128-row tiles, an experiment; "
                        "-s2: two K/V stages on 128-row tiles (the depth before 2026-12-02); "
                        "-wf: planned without the planner's final local search; "
                        "-pp / -np: with / without warpgroup ping-pong on 128-row tiles; "
                        "-pin: the PV wait pinned after the softmax; "
                        "-c3: 192-row tiles on three consumer warpgroups where ion-auto runs "
                        "128-row ones, an experiment; "
                        "fa3-layer: reshape_and_cache_flash of the new K/V, then fa3 (what a "
                        "FLASH_ATTN layer launches; compare with -fused); "
                        "-append: kv_append of the new K/V, then the attention; "
                        "-fused: fused KV writeback, one launch (what a vLLM layer runs by "
                        "default); ion: packed 64-row tiles; ion-auto: the vLLM backend's "
                        "default attention (no cache write, like fa3); -rc: the "
                        "row-parallel split-KV combine instead; -gc: the "
                        "group combine instead; ion-unpacked: unpacked prefill tiles; "
                        "ion-m128: 128-row tiles on two consumer warpgroups)")
    k.add_argument("--out", help="results dir (default bench/results/<date>-<gpu>)")
    k.add_argument("--iters", type=int, default=60, help="timed iterations per case/backend")
    k.add_argument("--warmup", type=int, default=10)
    k.add_argument("--no-ceilings", action="store_true",
                   help="skip the copy/GEMM ceiling measurement (reuse the dir's, if any)")
    k.add_argument("--timing", choices=("queued", "synced", "interleaved"), default="queued",
                   help="queued (default): calls queued behind a spacer, GPU time only, "
                        "one backend after the other; interleaved: the same, with every "
                        "backend of a case in one stream, alternating call by call, so "
                        "that all see the same moments of the run (clock or power phases); "
                        "synced: one call per sync, includes launch latency (to compare "
                        "with per-call benchmarks)")
    k.add_argument("--device", default="cuda")
    k.add_argument("--list", action="store_true", help="print the selected cases and exit")

    e = sub.add_parser("e2e", help="end-to-end A/B through vLLM's own bench throughput")
    e.add_argument("--workload", action="append", default=[],
                   help=f"repeatable / comma-separated: {', '.join(e2e_mod.WORKLOADS)}, all "
                        "(default seed)")
    e.add_argument("--backends", default="ION,FLASH_ATTN",
                   help="comma-separated --attention-backend values, in run order")
    e.add_argument("--repeats", type=int, default=2)
    e.add_argument("--model", default=str(e2e_mod.DEFAULT_MODEL_DIR),
                   help="local model dir (default: the demo model, created on first use)")
    e.add_argument("--num-prompts", type=int, help="override the workload's prompt count")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", help="results dir (default bench/results/<date>-<gpu>)")
    e.add_argument("--serve", action="store_true",
                   help="vllm serve + vllm bench serve (TTFT/TPOT p50/p99) instead of "
                        "bench throughput")
    e.add_argument("--colocate", action="store_true",
                   help="with --serve (implied): start one vllm serve per backend at the same "
                        "time on one GPU (--gpu-memory-utilization 0.90/N, --kv-cache-gib "
                        "each), serve every workload from them and alternate the bench runs "
                        "between them (one engine start per backend instead of one per "
                        "workload and backend)")
    e.add_argument("--kv-cache-gib", type=float, default=40.0,
                   help="--colocate: KV cache of each server in GiB (vLLM's "
                        "--kv-cache-memory-bytes; no KV-cache memory profiling)")
    e.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                   help="--colocate: start no bench run once this many seconds have passed "
                        "since the command began (0: no budget); results are built from "
                        "the runs that finished")
    e.add_argument("--disable-detokenize", action="store_true")
    e.add_argument("--num-warmups", type=int, default=4,
                   help="warm-up prompts before the timed run (vLLM's --num-warmups)")
    e.add_argument("--max-model-len", type=int)
    e.add_argument("--load-format", help="default: dummy when the model dir has no weights")
    e.add_argument("--vllm-arg", action="append", default=[],
                   help="extra argument passed to vLLM on both sides (repeatable; "
                        "use --vllm-arg=--flag)")
    e.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds before one vLLM run is killed")
    e.add_argument("--python", default=sys.executable,
                   help="interpreter that runs vLLM (default: this one)")
    e.add_argument("--accumulate", action="store_true",
                   help="keep the runs already in the dir's summary.json and add this "
                        "call's repeats to them (split repeats over several commands)")
    e.add_argument("--dry-run", action="store_true",
                   help="print the planned vLLM commands and exit")

    r = sub.add_parser("report", help="re-render table.md and plot.png from summary.json")
    r.add_argument("dir")
    return p


# --------------------------------------------------------------------------- kernel

def cmd_kernel(args) -> int:
    names = [n for c in args.case for n in _csv(c)]
    try:
        cases = kernel_suite.select(args.suite, names)
    except KeyError as err:
        _log(f"ion-bench: {err.args[0]}")
        return 2
    from . import kernel_runner  # numpy only at import; torch is imported per call

    backends = _csv(args.backends)
    bad = [b for b in backends if b not in kernel_runner.BACKENDS]
    if bad:
        _log(f"ion-bench: unknown kernel backend(s) {bad}")
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
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(dev)
    out = Path(args.out) if args.out else report.default_results_dir(gpu)
    out.mkdir(parents=True, exist_ok=True)
    label = ",".join(args.suite or []) or ("cases" if names else "smoke")
    _log(f"[kernel] {len(cases)} case(s) x {backends} on {gpu}; results -> {out}")
    ceil = {"gpu": gpu, "date": _dt.date.today().isoformat(), "versions": versions()}
    if not args.no_ceilings:
        m = kernel_runner.measure_ceilings(dev)
        ceil.update(m)
        _log(f"[kernel] ceilings: copy {m['copy_gbps']:.0f} GB/s, "
             f"bf16 GEMM {m['gemm_tflops']:.0f} TFLOP/s")
    else:
        old = report.load_summary(out).get("ceilings", {})
        for key in ("copy_gbps", "gemm_tflops"):
            if old.get(key):
                ceil.setdefault(key, old[key])
    report.update_summary(out, [], ceil)

    def flush(records):
        report.update_summary(out, records)

    recs = kernel_runner.run_kernel_suite(cases, backends, iters=args.iters, warmup=args.warmup,
                                          device=args.device, ceilings=ceil, suite_label=label,
                                          log=_log, on_record=flush, timing=args.timing)
    report.update_summary(out, recs)
    table, plot = report.render(out)
    _log(f"[kernel] wrote {out / 'summary.json'}, {table}, {plot}")
    return 0


# --------------------------------------------------------------------------- e2e

def _print_colocated(workloads, opts, out: Path) -> None:
    ports = {b: 8000 + i for i, b in enumerate(opts.backends)}
    _log("# colocated servers on one GPU, started together: "
         + ", ".join(f"{b} on port {p}" for b, p in ports.items()))
    for b, port in ports.items():
        env = e2e_mod.colocate_server_env(b, opts)
        _log(f"# server {b} (environment: "
             + " ".join(f"{k}={v}" for k, v in sorted(env.items())) + ")")
        _log(shlex.join(e2e_mod.colocate_serve_cmd(workloads, b, opts, port)))
    if opts.time_budget:
        _log(f"# no bench run starts after {opts.time_budget:.0f}s")
    for w, b, r, seed, cmd, _ in e2e_mod.plan_colocated(workloads, opts, out, ports):
        _log(f"# {w.name} / {b} / repeat {r + 1} (seed {seed}; prefix cache reset first)")
        _log(shlex.join(cmd))


def cmd_e2e(args) -> int:
    t_start = time.monotonic()
    try:
        workloads = e2e_mod.select_workloads(args.workload)
    except KeyError as err:
        _log(f"ion-bench: {err.args[0]}")
        return 2
    if args.repeats < 1:
        _log("ion-bench: --repeats must be >= 1")
        return 2
    if args.colocate:
        args.serve = True
        try:
            e2e_mod.check_colocatable(workloads)
        except ValueError as err:
            _log(f"ion-bench: {err}")
            return 2
        if args.kv_cache_gib <= 0:
            _log("ion-bench: --kv-cache-gib must be > 0")
            return 2
    elif args.time_budget:
        _log("ion-bench: --time-budget is only supported with --colocate")
        return 2
    if args.time_budget < 0:
        _log("ion-bench: --time-budget must be >= 0")
        return 2
    opts = e2e_mod.E2EOptions(
        model=args.model, backends=tuple(_csv(args.backends)), repeats=args.repeats,
        seed=args.seed, num_prompts=args.num_prompts,
        disable_detokenize=args.disable_detokenize, load_format=args.load_format,
        num_warmups=args.num_warmups, max_model_len=args.max_model_len,
        extra_args=tuple(args.vllm_arg), run_timeout=args.run_timeout, python=args.python,
        kv_cache_gib=args.kv_cache_gib, time_budget=args.time_budget)
    if args.dry_run:
        out = Path(args.out) if args.out else Path("bench/results/<date>-<gpu>")
        if args.colocate:
            _print_colocated(workloads, opts, out)
        elif args.serve:
            port = 8000
            for w in workloads:
                for b in opts.backends:
                    _log("# " + f"{w.name} / {b}: server, then {opts.repeats} x bench serve")
                    _log(shlex.join(e2e_mod.serve_cmd(w, b, opts, port)))
                    _log(shlex.join(e2e_mod.bench_serve_cmd(
                        w, opts, port, str(out / "raw"), f"{w.name}-serve-{b}-r0.json")))
        else:
            for w, b, r, cmd, _ in e2e_mod.plan_throughput(workloads, opts, out):
                _log(f"# {w.name} / {b} / repeat {r + 1}")
                _log(shlex.join(cmd))
        return 0
    try:
        e2e_mod.ensure_model(opts, log=_log)
        if args.colocate:
            e2e_mod.check_colocated_memory(len(opts.backends), opts.kv_cache_gib,
                                           e2e_mod.estimate_weight_bytes(opts.model),
                                           e2e_mod.gpu_total_bytes())
    except (FileNotFoundError, subprocess.CalledProcessError, ValueError) as err:
        _log(f"ion-bench: {err}")
        return 2
    gpu = gpu_name_via_subprocess(opts.python)
    out = Path(args.out) if args.out else report.default_results_dir(gpu)
    out.mkdir(parents=True, exist_ok=True)
    mode = "serve, colocated" if args.colocate else ("serve" if args.serve else "throughput")
    _log(f"[e2e] workloads {[w.name for w in workloads]} x {list(opts.backends)} x "
         f"{opts.repeats} repeats ({mode}); results -> {out}")
    report.update_summary(out, [], {"gpu": gpu, "date": _dt.date.today().isoformat(),
                                    "versions": versions()})

    def flush(records):
        report.update_summary(out, records)
        report.render(out)

    prior: dict = {}
    if args.accumulate:
        for rec in report.load_summary(out)["records"]:
            if rec.get("suite") == "e2e" and rec.get("runs"):
                prior.setdefault(rec["case"], {})[rec["backend"]] = rec["runs"]
    if args.colocate:
        recs = e2e_mod.run_serve_colocated(workloads, opts, out, log=_log, on_records=flush,
                                           prior=prior, t_start=t_start)
    else:
        runner = e2e_mod.run_serve if args.serve else e2e_mod.run_throughput
        recs = runner(workloads, opts, out, log=_log, on_records=flush, prior=prior)
    report.update_summary(out, recs)
    table, plot = report.render(out)
    for rec in recs:
        rat = rec.get(f"ratio_total_tok_s_vs_{report.E2E_BASELINE}")
        if rat:
            _log(f"[e2e] {rec['case']}: ION/FLASH_ATTN total tok/s = {rat['ratio']:.3f} "
                 f"(per-repeat {rat['ratio_min']:.3f}..{rat['ratio_max']:.3f})")
    _log(f"[e2e] wrote {out / 'summary.json'}, {table}, {plot}")
    skipped = [r for r in recs if r.get("status") == "skipped"]
    if skipped:
        _log("[e2e] not run within the time budget: "
             + ", ".join(f"{r['case']}/{r['backend']}" for r in skipped))
    failed = [r for r in recs if r.get("status") not in ("ok", "skipped")]
    return 1 if failed else 0


# --------------------------------------------------------------------------- report

def cmd_report(args) -> int:
    d = Path(args.dir)
    if not (d / "summary.json").exists():
        _log(f"ion-bench: no summary.json in {d}")
        return 2
    table, plot = report.render(d)
    _log(f"wrote {table}" + (f" and {plot}" if plot else " (no plottable records)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"kernel": cmd_kernel, "e2e": cmd_e2e, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
