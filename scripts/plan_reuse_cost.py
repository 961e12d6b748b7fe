#!/usr/bin/env python
"""Host time of ION's metadata build per engine step, with and without plan reuse
(``ION_PLAN_REUSE``), on the decode phase of the seed workload's shape.

The sixteenth session's profile of seed (``scripts/attention_share.py``) found the GPU
idle for 224 us a step under ION (15 us under FLASH_ATTN) between vLLM's input kernels
and the forward: the metadata build runs there, and the host is not far enough ahead for
async scheduling to hide it.  This script times ``IonAttentionMetadataBuilder.build`` (the
planner, its tile-size choice and the plan upload into the persistent buffers) on the CPU
with the Qwen2.5-7B attention shape (28 q / 4 KV heads, d 128, 64-token pages, fused
writeback, the default options) over ``--steps`` decode steps of ``--requests`` requests
whose lengths start spread over ``--start``..``--start + 64`` and grow one token a step,
alternating the two settings ``--repeats`` times:

    python scripts/plan_reuse_cost.py --out bench/results/2026-12-03-cpu/plan-reuse.json

Absolute times are this CPU's; the ratio and the reuse share are the point.
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


def _setup() -> str:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    sys.path.insert(0, ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pytest
    from conftest import force_cpu_platform
    from make_demo_model import QWEN25_7B_CONFIG

    force_cpu_platform(pytest.MonkeyPatch())
    d = tempfile.mkdtemp(prefix="ion-plan-reuse-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(QWEN25_7B_CONFIG, f)
    return d


def make_builder(model_dir: str, requests: int, reuse: bool):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from ion_vllm.backend import PLAN_REUSE_ENV, IonAttentionMetadataBuilder

    os.environ[PLAN_REUSE_ENV] = "1" if reuse else "0"
    cfg = EngineArgs(model=model_dir, attention_backend="ION", skip_tokenizer_init=True,
                     load_format="dummy", max_num_seqs=requests,
                     max_model_len=16384).create_engine_config()
    spec = FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=128,
                             dtype=torch.bfloat16)
    return IonAttentionMetadataBuilder(spec, [], cfg, torch.device("cpu"))


def run(builder, requests: int, steps: int, start: int) -> list[float]:
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(requests + 1, dtype=torch.int32)
    bt = torch.arange(requests * 256, dtype=torch.int32).reshape(requests, 256)
    slots = torch.zeros(requests, dtype=torch.int64)
    base = torch.tensor([start + (i * 64) // requests for i in range(requests)],
                        dtype=torch.int32)
    times = []
    for s in range(steps):
        sl = base + s
        md = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=sl,
            num_reqs=requests, num_actual_tokens=requests, max_query_len=1,
            max_seq_len=int(sl.max()), block_table_tensor=bt, slot_mapping=slots,
            seq_lens_cpu_upper_bound=sl, _seq_lens_cpu=sl)
        t = time.perf_counter()
        builder.build(0, md)
        times.append(time.perf_counter() - t)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--start", type=int, default=7680)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model_dir = _setup()
    res = {"requests": args.requests, "steps": args.steps, "start": args.start, "runs": []}
    for r in range(args.repeats):
        for reuse in (False, True):
            b = make_builder(model_dir, args.requests, reuse)
            run(b, args.requests, 8, args.start - 64)  # warm-up (first plans, imports)
            b.plans_made = b.plans_reused = 0
            t = run(b, args.requests, args.steps, args.start)
            res["runs"].append({"repeat": r, "reuse": reuse,
                                "mean_us": 1e6 * statistics.fmean(t),
                                "median_us": 1e6 * statistics.median(t),
                                "plans_made": b.plans_made, "plans_reused": b.plans_reused})
    for reuse in (False, True):
        rs = [x for x in res["runs"] if x["reuse"] == reuse]
        res["reuse" if reuse else "no_reuse"] = {
            "mean_us": statistics.fmean(x["mean_us"] for x in rs),
            "reused_share": statistics.fmean(
                x["plans_reused"] / max(1, x["plans_made"] + x["plans_reused"]) for x in rs)}
    res["mean_ratio"] = res["reuse"]["mean_us"] / res["no_reuse"]["mean_us"]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'setting':<10}{'mean us':>10}{'median us':>11}{'made':>7}{'reused':>8}")
    for x in res["runs"]:
        print(f"{'reuse' if x['reuse'] else 'plan':<10}{x['mean_us']:10.1f}"
              f"{x['median_us']:11.1f}{x['plans_made']:7d}{x['plans_reused']:8d}")
    print(f"mean build time with reuse / without: {res['mean_ratio']:.3f}; steps reusing a "
          f"plan: {res['reuse']['reused_share']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
