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
engine's. The difference between the policies on the same host is the point.
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


def run_once(model_dir: str, prompt_only: bool, requests: int, prompt: int, gen: int,
             seed: int = 0) -> dict:
    import test_kv_tier_scheduler as T

    extra = {"offload_prompt_only": True} if prompt_only else None
    eng = T.Engine(model_dir, gpu_blocks=requests * ((prompt + gen) // T.BS + 2) + 64,
                   host_blocks=requests * ((prompt + gen) // T.BS + 2), max_num_seqs=requests,
                   max_batched=max(2048, requests), extra=extra, store_lag=1)
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
        "prompt_only": prompt_only,
        "steps": n,
        "schedule_us": statistics.median(times["schedule"][k:]) * 1e6,
        "update_us": statistics.median(times["update"][k:]) * 1e6,
        "manager_us_per_step": {m: sum(times[m]) / n * 1e6 for m in MANAGER_METHODS},
        "store_jobs": sum(len(m.store_jobs) for _, _, m in eng.outputs),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", help="write every run as JSON here")
    args = ap.parse_args(argv)
    if args.prompt + args.gen > 1024:
        ap.error("prompt + gen must fit the harness's max_model_len of 1024")
    model_dir = _setup()
    runs = []
    for _ in range(args.repeats):
        for po in (False, True):
            r = run_once(model_dir, po, args.requests, args.prompt, args.gen)
            runs.append(r)
            mgr = sum(r["manager_us_per_step"].values())
            print(f"{'prompt-only' if po else 'eager':<12} steps {r['steps']:4d}  "
                  f"schedule {r['schedule_us']:7.0f} us  update {r['update_us']:7.0f} us  "
                  f"Ion manager {mgr:6.0f} us/step  store jobs {r['store_jobs']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
