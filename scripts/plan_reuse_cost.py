#!/usr/bin/env python
"""Host time of ION's metadata build per engine step, planning every step, with
plan reuse (``ION_PLAN_REUSE``) and with repaged decode plans as well (``ION_PLAN_REPAGE``),
on the decode phase of the seed workload's shape.

The sixteenth session's profile of seed (``scripts/attention_share.py``) found the GPU
idle for 224 us a step under ION (15 us under FLASH_ATTN) between vLLM's input kernels
and the forward: the metadata build runs there, and the host is not far enough ahead for
async scheduling to hide it.  This script times ``IonAttentionMetadataBuilder.build`` (the
planner, its tile-size choice and the plan upload into the persistent buffers) on the CPU
with the Qwen2.5-7B attention shape (28 q / 4 KV heads, d 128, 64-token pages, fused
writeback, the default options) over ``--steps`` decode steps of ``--requests`` requests
whose lengths start spread over ``--start``..``--start + 64`` and grow one token a step,
alternating the three settings ``--repeats`` times:

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


SETTINGS = {"plan": ("0", "0"), "reuse": ("1", "0"), "repage": ("1", "1")}


def make_builder(model_dir: str, requests: int, setting: str):
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from ion_vllm.backend import PLAN_REPAGE_ENV, PLAN_REUSE_ENV, IonAttentionMetadataBuilder

    os.environ[PLAN_REUSE_ENV], os.environ[PLAN_REPAGE_ENV] = SETTINGS[setting]
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
        for setting in SETTINGS:
            b = make_builder(model_dir, args.requests, setting)
            run(b, args.requests, 8, args.start - 64)  # warm-up (first plans, imports)
            b.plans_made = b.plans_reused = b.plans_repaged = 0
            t = run(b, args.requests, args.steps, args.start)
            res["runs"].append({"repeat": r, "setting": setting,
                                "mean_us": 1e6 * statistics.fmean(t),
                                "median_us": 1e6 * statistics.median(t),
                                "plans_made": b.plans_made, "plans_reused": b.plans_reused,
                                "plans_repaged": b.plans_repaged})
    for setting in SETTINGS:
        rs = [x for x in res["runs"] if x["setting"] == setting]
        res[setting] = {"mean_us": statistics.fmean(x["mean_us"] for x in rs),
                        "planned_share": statistics.fmean(
                            x["plans_made"] / max(1, x["plans_made"] + x["plans_reused"]
                                                  + x["plans_repaged"]) for x in rs)}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'setting':<10}{'mean us':>10}{'median us':>11}{'made':>7}{'reused':>8}"
          f"{'repaged':>9}")
    for x in res["runs"]:
        print(f"{x['setting']:<10}{x['mean_us']:10.1f}{x['median_us']:11.1f}"
              f"{x['plans_made']:7d}{x['plans_reused']:8d}{x['plans_repaged']:9d}")
    for setting in SETTINGS:
        print(f"{setting}: mean {res[setting]['mean_us']:.1f} us a step, "
              f"{res[setting]['planned_share']:.1%} of steps planned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
