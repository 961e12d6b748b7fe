#!/usr/bin/env python3
"""Fast GPU smoke check of IonAttention: a few correctness cases plus ION-only timings.

One self-contained call on the H200 (CuTeDSL bundle only, no vLLM needed):
    . .gpu/cute/env.sh && python3 scripts/kernel_check.py --out $OUT
Correctness: fresh randn inputs per case, output poisoned with NaN, compared with the fp32
reference by ||out-ref||/||ref||; rows of requests without new tokens must stay poisoned.
Timing: CUDA events, warm-up, median over iterations, KV buffers rotated past L2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cute_kernels.attention import ion_attention, make_device_plan  # noqa: E402
from cute_kernels.reference import (  # noqa: E402
    make_paged_case, reference_paged_attention, relative_error, written_rows_mask)

CASES = [
    # name, q_lens, seq_lens, Hq, Hkv, D, dtype
    ("decode-mixed-g7", [1, 1, 1, 1], [1, 64, 65, 1000], 28, 4, 128, torch.bfloat16),
    ("prefill-g7", [300], [300], 28, 4, 128, torch.bfloat16),
    ("chunk-g7", [100, 1, 0, 37], [900, 4097, 50, 37], 28, 4, 128, torch.bfloat16),
    ("mixed-g1-d64", [1, 130, 1, 5], [129, 130, 7, 64], 8, 8, 64, torch.bfloat16),
    ("mixed-g4-fp16", [1, 70, 1], [3000, 200, 64], 16, 4, 128, torch.float16),
    ("mixed-g8-d64", [2, 1, 65], [2, 513, 128], 32, 4, 64, torch.bfloat16),
    ("long-decode-g7", [1, 1], [32768, 20000], 28, 4, 128, torch.bfloat16),
    ("split-decode-g7", [1] * 8, [32768, 1, 64, 6000, 12345, 129, 4096, 30000], 28, 4, 128,
     torch.bfloat16),
    ("split-chunk-g4-d64", [1, 200, 1], [50000, 9000, 777], 16, 4, 64, torch.bfloat16),
]


def check_case(name, q_lens, seq_lens, Hq, Hkv, D, dtype, seed, allow_split=True):
    case = make_paged_case(seed, q_lens, seq_lens, Hq, Hkv, D, page=64, dtype=dtype, device="cuda")
    q, kc, vc, qsl, sl, bt = case
    scale = 1.0 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))
    plan = make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=Hkv, group_size=Hq // Hkv,
                            page_size=64, head_dim=D, device="cuda", allow_split=allow_split)
    ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan)
    torch.cuda.synchronize()
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale)
    mask = written_rows_mask(qsl, sl, q.shape[0]).to(out.device)
    err = relative_error(out[mask], ref[mask]) if mask.any() else 0.0
    nan_written = bool(torch.isnan(out[mask]).any())
    untouched_ok = bool(torch.isnan(out[~mask]).all()) if (~mask).any() else True
    ok = err <= 1e-2 and not nan_written and untouched_ok
    return dict(case=name, rel_err=float(err), nan_in_written=nan_written,
                untouched_rows_poisoned=untouched_ok, ok=ok, split_groups=plan.num_groups,
                max_splits=plan.host.num_splits_max)


def time_case(name, q_lens, seq_lens, Hq, Hkv, D, dtype, iters=50):
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    cases = []
    kv_bytes = 0
    while True:
        c = make_paged_case(len(cases) + 100, q_lens, seq_lens, Hq, Hkv, D, page=64, dtype=dtype,
                            device="cuda", spare_pages=0)
        cases.append(c)
        kv_bytes = c.k_cache.numel() * c.k_cache.element_size() * 2
        if kv_bytes * len(cases) >= 2 * l2 and len(cases) >= 2:
            break
    q, kc, vc, qsl, sl, bt = cases[0]
    plan = make_device_plan(qsl.cpu(), sl.cpu(), num_kv_heads=Hkv, group_size=Hq // Hkv,
                            page_size=64, head_dim=D, device="cuda")
    outs = [torch.empty_like(c.q) for c in cases]
    scale = 1.0 / math.sqrt(D)

    def run(i):
        c = cases[i % len(cases)]
        ion_attention(c.q, c.k_cache, c.v_cache, outs[i % len(cases)], c.query_start_loc,
                      c.seq_lens, c.block_table, scale, plan)

    for i in range(5):
        run(i)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    med = statistics.median(times)
    # bytes: KV of every request read once + q read + out written
    kv_tok = sum(seq_lens)
    bytes_moved = kv_tok * Hkv * D * 2 * 2 + 2 * sum(q_lens) * Hq * D * 2
    flops = 0
    for ql, L in zip(q_lens, seq_lens):
        # causal: token i attends L-ql+i+1 keys
        keys = ql * (L - ql) + ql * (ql + 1) / 2
        flops += 4 * keys * Hq * D
    return dict(case=name, median_us=med, gbps=bytes_moved / med / 1e3,
                tflops=flops / med / 1e6, rotations=len(cases), split_groups=plan.num_groups,
                max_splits=plan.host.num_splits_max)


TIMING = [
    ("decode-32x8192", [1] * 32, [8192] * 32, 28, 4, 128, torch.bfloat16),
    ("decode-128x2048", [1] * 128, [2048] * 128, 28, 4, 128, torch.bfloat16),
    ("prefill-8192", [8192], [8192], 28, 4, 128, torch.bfloat16),
    ("decode32x8k+prefill2048", [1] * 32 + [2048], [8192] * 32 + [2048], 28, 4, 128, torch.bfloat16),
    ("decode-8x32768", [1] * 8, [32768] * 8, 28, 4, 128, torch.bfloat16),
    ("decode-32-skewed", [1] * 32, [int(x) for x in torch.randint(512, 16385, (32,),
     generator=torch.Generator().manual_seed(0))], 28, 4, 128, torch.bfloat16),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/kernel-check"))
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.cuda.get_device_name(0), "seed", args.seed, flush=True)
    results = []
    for i, c in enumerate(CASES):
        t0 = time.time()
        try:
            r = check_case(*c, seed=args.seed + i)
        except Exception as exc:  # report and continue: one broken case must not hide others
            r = dict(case=c[0], ok=False, error=f"{type(exc).__name__}: {exc}")
        r["seconds"] = round(time.time() - t0, 2)
        print(json.dumps(r), flush=True)
        results.append(r)
    timings = []
    if not args.no_timing and all(r["ok"] for r in results):
        for c in TIMING:
            r = time_case(*c)
            print(json.dumps(r), flush=True)
            timings.append(r)
    with open(os.path.join(args.out, "kernel_check.json"), "w") as f:
        json.dump(dict(seed=args.seed, gpu=torch.cuda.get_device_name(0), correctness=results,
                       timing=timings), f, indent=1)
    print("\n| case | ok | rel err |")
    for r in results:
        print(f"| {r['case']} | {r['ok']} | {r.get('rel_err', r.get('error'))} |")
    for r in timings:
        print(f"| {r['case']} | {r['median_us']:.1f} us | {r['gbps']:.0f} GB/s | {r['tflops']:.0f} TFLOP/s | splits {r['max_splits']} |")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
