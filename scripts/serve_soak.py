#!/usr/bin/env python3
"""Serving soak: ``vllm serve`` with ION and the KV tier under many streaming clients.

Usage (on the GPU host, project installed):
  python3 scripts/serve_soak.py --model bench/demo-model --out OUT [--requests 2000]

One server (dummy weights, ``--attention-backend ION``, the Ion KV tier with
``kv_load_failure_policy: recompute``, a KV pool of ``--gpu-blocks`` blocks) and
``--rounds`` rounds of two phases of streaming ``/v1/completions`` clients at
``--concurrency``:

1. ``mixed``: ``--requests`` requests of mixed prompt and output lengths over shared
   prefixes (prefix hits on the GPU and from the host tier);
2. ``pressure``: ``--pressure-requests`` long requests whose KV is several times the pool,
   so vLLM preempts and the tier restores.

In both, ``--disconnect`` of the clients (chosen up front, seeded) close their connection
after a few streamed chunks.  Measured: failed requests (other than the disconnected ones),
server log lines at ERROR level or with a traceback, the server's host RSS (its whole
process tree) and GPU memory sampled every ``--sample-s`` seconds, and vLLM's and the
tier's Prometheus counters.  The run passes when no request fails, the log has no error,
the run spans at least ``MIN_SPAN_S`` (so its first and last minute are apart), and host and
GPU memory of the last minute are within ``--flat-mib`` of the first minute's.  Everything
lands in OUT/summary.json (and OUT/serve.log, OUT/samples.jsonl, OUT/<phase>.jsonl).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

VOCAB = 150000  # token ids below the demo tokenizer's special tokens
#: a server log line that counts as an error
ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|CUDA error|"
                        r"EngineCore\b.*\b(died|failed)\b|Segmentation fault")
#: Prometheus counters reported (name -> summed value over label sets)
METRICS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total",
           "vllm:generation_tokens_total", "vllm:request_success_total",
           "vllm:ion_kv_tier_loaded_blocks_total", "vllm:ion_kv_tier_stored_blocks_total",
           "vllm:ion_kv_tier_failed_load_blocks_total",
           "vllm:ion_kv_tier_evicted_blocks_total")


@dataclass(frozen=True)
class Req:
    idx: int
    prefix: int  # which shared prefix
    prompt_len: int  # tokens after the prefix
    max_tokens: int
    disconnect_after: int  # streamed chunks before the client hangs up (0: never)


def plan_phase(rng: random.Random, n: int, prefixes: int, prompt: tuple[int, int],
               out: tuple[int, int], disconnect: float) -> list[Req]:
    """``n`` requests; exactly round(disconnect * n) of them hang up mid-stream."""
    hang = set(rng.sample(range(n), round(disconnect * n)))
    return [Req(i, rng.randrange(prefixes), rng.randint(*prompt), rng.randint(*out),
                rng.randint(2, 8) if i in hang else 0) for i in range(n)]


def error_lines(log_text: str) -> list[str]:
    return [ln for ln in log_text.splitlines() if ERROR_LINE.search(ln)]


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each counter in METRICS over its label sets."""
    out = {m: 0.0 for m in METRICS}
    for ln in text.splitlines():
        if ln.startswith("#"):
            continue
        name = ln.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            try:
                out[name] += float(ln.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


#: a memory judgement needs a first and a last minute that do not overlap, and time between
MIN_SPAN_S = 150.0


def flatness(samples: list[dict], key: str, window_s: float = 60.0) -> dict:
    """Mean of ``key`` over the first and the last ``window_s`` of the samples (MiB)."""
    t0, t1 = samples[0]["t"], samples[-1]["t"]
    first = [s[key] for s in samples if s["t"] - t0 <= window_s]
    last = [s[key] for s in samples if t1 - s["t"] <= window_s]
    a, b = statistics.fmean(first), statistics.fmean(last)
    return {"first_min_mib": round(a, 1), "last_min_mib": round(b, 1),
            "growth_mib": round(b - a, 1), "span_s": round(t1 - t0, 1)}


# ------------------------------------------------------------------ measurements
def tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss_mib(pids: list[int]) -> float:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def _smi(*query: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def gpu_used_mib() -> float:
    """The whole GPU's used memory (MiB)."""
    try:
        return float(_smi("--query-gpu=memory.used").split()[0])
    except (ValueError, IndexError):
        return float("nan")


def gpu_tree_mib(pids: list[int]) -> float:
    """GPU memory of the given processes (MiB): the server alone, when other jobs share the
    GPU; NaN where nvidia-smi lists none of them (another PID namespace)."""
    want, total, seen = set(pids), 0.0, False
    for line in _smi("--query-compute-apps=pid,used_memory").splitlines():
        try:
            pid, mib = (x.strip() for x in line.split(","))
            if int(pid) in want:
                total, seen = total + float(mib), True
        except ValueError:
            continue
    return total if seen else float("nan")


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


# ------------------------------------------------------------------ clients
async def one_request(session, url: str, model: str, req: Req, prefix_ids: list[int],
                      seed: int) -> dict:
    rng = random.Random(seed * 1_000_003 + req.idx)
    prompt = prefix_ids + [rng.randrange(VOCAB) for _ in range(req.prompt_len)]
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    chunks = 0
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return {"idx": req.idx, "ok": False, "status": r.status,
                        "error": (await r.text())[:300]}
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                chunks += 1
                if req.disconnect_after and chunks >= req.disconnect_after:
                    r.close()  # the client goes away mid-stream
                    return {"idx": req.idx, "ok": True, "disconnected": True,
                            "chunks": chunks}
        done = req.disconnect_after == 0
        ok = done and chunks >= 1
        return {"idx": req.idx, "ok": ok, "chunks": chunks,
                "latency_s": time.monotonic() - t0,
                **({} if ok else {"error": f"stream ended after {chunks} chunks"})}
    except Exception as e:  # noqa: BLE001 - every client failure is counted
        return {"idx": req.idx, "ok": False, "error": repr(e)[:300], "chunks": chunks}


async def run_phase(url: str, model: str, reqs: list[Req], prefixes: list[list[int]],
                    concurrency: int, seed: int) -> list[dict]:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        async def guarded(r: Req):
            async with sem:
                return await one_request(session, url, model, r, prefixes[r.prefix], seed)
        return await asyncio.gather(*(guarded(r) for r in reqs))


# ------------------------------------------------------------------ main
def server_cmd(a: argparse.Namespace, port: int) -> list[str]:
    tier = {"kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"spec_name": "IonKVTier"}}
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model,
            "--load-format", "dummy", "--attention-backend", "ION", "--port", str(port),
            "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
            "--num-gpu-blocks-override", str(a.gpu_blocks),
            "--gpu-memory-utilization", str(a.gpu_memory_utilization),
            "--kv-offloading-size", str(a.host_gib),
            "--kv-transfer-config", json.dumps(tier)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench/demo-model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pressure-requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=1,
                    help="mixed + pressure rounds: memory is judged over the whole run, "
                         "which must span >= MIN_SPAN_S")
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--disconnect", type=float, default=0.05)
    ap.add_argument("--gpu-blocks", type=int, default=4096, help="KV pool, 64-token blocks")
    ap.add_argument("--host-gib", type=float, default=32.0)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--flat-mib", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=None, help="default: fresh, recorded")
    ap.add_argument("--startup-s", type=float, default=600.0)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds for the whole run (0: none); a phase cut short fails")
    a = ap.parse_args(argv)

    from ion_vllm.bench.e2e import free_port, kill_group, wait_healthy

    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([256, 512, 1024, 2048]))]
                for _ in range(16)]
    phases = {}
    for r in range(a.rounds):  # each round: the mixed phase, then the pressure phase
        sfx = f"-{r + 1}" if a.rounds > 1 else ""
        phases["mixed" + sfx] = plan_phase(rng, a.requests, len(prefixes), (16, 1024),
                                           (16, 256), a.disconnect)
        phases["pressure" + sfx] = plan_phase(rng, a.pressure_requests, len(prefixes),
                                              (2048, 4096), (128, 384), a.disconnect)
    port = free_port()
    cmd = server_cmd(a, port)
    log_path = out / "serve.log"
    t_start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    summary: dict = {"command": " ".join(sys.argv), "server": cmd, "seed": seed,
                     "args": vars(a)}
    samples: list[dict] = []
    stop = asyncio.Event()

    def sample() -> dict:
        pids = tree_pids(proc.pid)
        return {"t": time.monotonic(), "rss_mib": tree_rss_mib(pids),
                "gpu_mib": gpu_used_mib(), "gpu_server_mib": gpu_tree_mib(pids)}

    async def sampler():
        while not stop.is_set():
            # off the event loop: nvidia-smi and the process walk would stall the clients
            samples.append(await asyncio.to_thread(sample))
            try:
                await asyncio.wait_for(stop.wait(), a.sample_s)
            except asyncio.TimeoutError:
                pass

    async def drive():
        task = asyncio.create_task(sampler())
        url = f"http://127.0.0.1:{port}/v1/completions"
        for name, reqs in phases.items():
            m0 = parse_metrics(get(f"http://127.0.0.1:{port}/metrics"))
            t0 = time.monotonic()
            left = (a.time_budget - (t0 - t_start) - 20) if a.time_budget else None
            if left is not None and left <= 0:
                raise TimeoutError(f"--time-budget {a.time_budget:.0f}s spent before {name}")
            res = await asyncio.wait_for(
                run_phase(url, a.model, reqs, prefixes, a.concurrency, seed), left)
            m1 = parse_metrics(get(f"http://127.0.0.1:{port}/metrics"))
            failed = [r for r in res if not r["ok"]]
            summary.setdefault("phases", {})[name] = {
                "requests": len(res), "concurrency": a.concurrency,
                "disconnected": sum(1 for r in res if r.get("disconnected")),
                "completed": sum(1 for r in res if r["ok"] and not r.get("disconnected")),
                "failed": len(failed), "failures": failed[:20],
                "seconds": round(time.monotonic() - t0, 1),
                "metrics_delta": {k: m1[k] - m0[k] for k in METRICS},
            }
            (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))
        stop.set()
        await task

    rc = 1
    try:
        wait_healthy(port, proc, a.startup_s)
        summary["startup_s"] = round(time.monotonic() - t_start, 1)
        asyncio.run(drive())  # its sampler takes the first sample at once
        summary["server_alive_at_end"] = proc.poll() is None
    except Exception as e:  # noqa: BLE001 - recorded, the run fails
        summary["error"] = repr(e)
    finally:
        if proc.poll() is None:
            kill_group(proc, grace=10.0)
    log_text = log_path.read_text(errors="replace")
    errs = error_lines(log_text)
    summary["server_error_lines"] = len(errs)
    summary["server_errors"] = errs[:30]
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if len(samples) >= 3:
        summary["host_rss"] = flatness(samples, "rss_mib")
        # the server's own GPU memory where nvidia-smi can attribute it (other jobs may
        # share the GPU), else the whole GPU's
        per_proc = not any(math.isnan(s["gpu_server_mib"]) for s in samples)
        summary["gpu_memory"] = flatness(samples, "gpu_server_mib" if per_proc else "gpu_mib")
        summary["gpu_memory"]["measured"] = "server processes" if per_proc else "whole GPU"
    ph = summary.get("phases", {})
    span = summary.get("host_rss", {}).get("span_s", 0.0)
    checks = {
        "no_failed_requests": len(ph) == len(phases) and all(p["failed"] == 0
                                                             for p in ph.values()),
        "long_enough_to_judge_memory": span >= MIN_SPAN_S,
        "no_server_errors": not errs,
        "server_survived": summary.get("server_alive_at_end", False),
        "host_memory_flat": abs(summary.get("host_rss", {}).get("growth_mib", 1e9))
        <= a.flat_mib,
        "gpu_memory_flat": abs(summary.get("gpu_memory", {}).get("growth_mib", 1e9))
        <= a.flat_mib,
        "preempted_and_restored": any(
            n.startswith("pressure") and p["metrics_delta"]["vllm:num_preemptions_total"] > 0
            and p["metrics_delta"]["vllm:ion_kv_tier_loaded_blocks_total"] > 0
            for n, p in ph.items()),
    }
    summary["checks"] = checks
    summary["passed"] = all(checks.values())
    if all(checks.values()):
        rc = 0
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: summary.get(k) for k in ("passed", "checks", "startup_s",
                                                   "host_rss", "gpu_memory")}, default=str))
    for name, p in ph.items():
        print(name, {k: p[k] for k in ("requests", "completed", "disconnected", "failed",
                                       "seconds")}, p["metrics_delta"])
    return rc


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
