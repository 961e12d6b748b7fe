#!/usr/bin/env python
"""Host CPU time per engine step of vLLM's scheduler with the Ion KV tier: the eager
policy (every full block stored, decode blocks too) against prompt-only storing.

Runs vLLM 0.26's real ``Scheduler`` + ``OffloadingConnector`` with the Ion manager on the
CPU, through the harness of ``tests/test_kv_tier_scheduler.py`` (its ``FakeWorker``
stands in for the model runner), and times only ``Scheduler.schedule()`` and
``Scheduler.update_from_output()``, i.e. what the engine core's scheduling costs per step.
The Ion manager's own methods are timed alongside, which separates Ion's code from
vLLM's connector-scheduler code. Medians over the decode steps (the last three quarters
of the steps), alternating the policies ``--repeats`` times:

    python scripts/kv_tier_sched_cost.py --requests 32 --prompt 512 --gen 400

The harness uses 16-token blocks and a 2-layer model, so absolute numbers are not a real
engine's. The difference between the configs on the same host is the point.

``--configs`` picks what alternates: ``eager`` (Ion's spec and policy), ``prompt-only``
(Ion's spec, vLLM's default policy) and ``native-default`` (vLLM's own
``CPUOffloadingSpec`` at its defaults, the issue's "native OffloadingConnector"); the
manager's methods are timed the same way for vLLM's manager.

Each run also counts engine steps, preemptions and the store jobs vLLM flushes (its worker
waits on the host for those before the step's forward). ``--pool-requests N`` sizes the GPU
pool for N requests (fewer than ``--requests`` preempts), ``--async-scheduling`` runs the
scheduler as on CUDA, ``--store-lag`` sets how many steps a store takes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANAGER_METHODS = ("prepare_store", "complete_store", "touch", "lookup", "prepare_load",
                   "get_stats")


def _setup():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pytest
    from conftest import force_cpu_platform

    force_cpu_platform(pytest.MonkeyPatch())
    from test_registration import TINY_QWEN2

    from ion_vllm.kv_tier import register_kv_tier

    register_kv_tier()
    d = tempfile.mkdtemp(prefix="ion-sched-cost-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(TINY_QWEN2, f)
    return d


#: config name -> the connector's extra config on top of the harness's Ion spec
CONFIGS = {
    "eager": {},  # Ion's spec and policy: every full block, decode blocks too
    "prompt-only": {"offload_prompt_only": True},  # Ion's spec, vLLM's default policy
    # vLLM's own spec (CPUOffloadingSpec, its LRU manager) at its defaults: prompt blocks
    # only; the "native OffloadingConnector" (the benchmark's native-default)
    "native-default": {"spec_name": "CPUOffloadingSpec"},
}


def run_once(model_dir: str, config: str, requests: int, prompt: int, gen: int,
             seed: int = 0, pool_requests: int | None = None,
             async_scheduling: bool = False, store_lag: int = 1) -> dict:
    """``config``: a key of ``CONFIGS``.  ``pool_requests``: size the GPU pool for that
    many requests (fewer than ``requests`` forces preemption and block reuse); None: room
    for all of them.  ``store_lag``: engine steps a store job takes to finish (the
    harness's FakeWorker)."""
    import test_kv_tier_scheduler as T

    extra = CONFIGS[config]
    per_req = (prompt + gen) // T.BS + 2
    gpu_blocks = requests * per_req + 64 if pool_requests is None else pool_requests * per_req
    eng = T.Engine(model_dir, gpu_blocks=gpu_blocks,
                   host_blocks=requests * per_req, max_num_seqs=requests,
                   max_batched=max(2048, requests), extra=extra, store_lag=store_lag,
                   async_scheduling=async_scheduling)
    times = {name: [] for name in ("schedule", "update", *MANAGER_METHODS)}

    def timed(fn, bucket):
        def wrap(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                bucket.append(time.perf_counter() - t)
        return wrap

    eng.sched.schedule = timed(eng.sched.schedule, times["schedule"])
    eng.sched.update_from_output = timed(eng.sched.update_from_output, times["update"])
    for m in MANAGER_METHODS:
        if hasattr(eng.mgr, m):
            setattr(eng.mgr, m, timed(getattr(eng.mgr, m), times[m]))
    reqs = [eng.add(f"r{i}", T._prompt(seed + i, prompt), gen) for i in range(requests)]
    eng.run_to_completion(*reqs)
    n = len(times["schedule"])
    k = n // 4  # the prefill steps come first
    return {
        "config": config,
        "prompt_only": config != "eager",
        "manager": type(eng.mgr).__name__,
        "steps": n,
        "schedule_us": statistics.median(times["schedule"][k:]) * 1e6,
        "update_us": statistics.median(times["update"][k:]) * 1e6,
        "manager_us_per_step": {m: sum(times[m]) / n * 1e6 for m in MANAGER_METHODS},
        "store_jobs": sum(len(m.store_jobs) for _, _, m in eng.outputs),
        "preemptions": sum(len(o.preempted_req_ids or ()) for _, o, _ in eng.outputs),
        # vLLM's worker waits on the host for every flushed job before the step's forward
        # (OffloadingConnectorWorker.handle_preemptions -> OffloadingWorker.wait); a job
        # flushed in the step that created it waits for the forward then in flight
        "flush_steps": sum(1 for _, _, m in eng.outputs if m.jobs_to_flush),
        "flushed_jobs": sum(len(m.jobs_to_flush or ()) for _, _, m in eng.outputs),
        "flushed_in_own_step": sum(len(set(m.jobs_to_flush or ()) & set(m.store_jobs))
                                   for _, _, m in eng.outputs),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pool-requests", type=int, default=None,
                    help="GPU pool for this many requests (default: all; fewer preempts)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="as vLLM runs on CUDA (defers block frees while a batch is in flight)")
    ap.add_argument("--store-lag", type=int, default=1,
                    help="engine steps a store job takes to finish")
    ap.add_argument("--configs", default="eager,prompt-only",
                    help=f"comma-separated, alternated per repeat: {', '.join(CONFIGS)}")
    ap.add_argument("--out", help="write every run as JSON here")
    args = ap.parse_args(argv)
    if args.prompt + args.gen > 1024:
        ap.error("prompt + gen must fit the harness's max_model_len of 1024")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        ap.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    model_dir = _setup()
    runs = []
    for _ in range(args.repeats):
        for config in configs:
            r = run_once(model_dir, config, args.requests, args.prompt, args.gen,
                         pool_requests=args.pool_requests,
                         async_scheduling=args.async_scheduling, store_lag=args.store_lag)
            runs.append(r)
            mgr = sum(r["manager_us_per_step"].values())
            print(f"{config:<14} steps {r['steps']:4d}  "
                  f"schedule {r['schedule_us']:7.0f} us  update {r['update_us']:7.0f} us  "
                  f"manager {mgr:6.0f} us/step (get_stats "
                  f"{r['manager_us_per_step']['get_stats']:4.0f})  store jobs {r['store_jobs']}  "
                  f"preemptions {r['preemptions']}  flushed jobs {r['flushed_jobs']} "
                  f"({r['flushed_in_own_step']} in their own step)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
