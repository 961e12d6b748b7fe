#!/usr/bin/env python
"""Hardware counters of one kernel-suite case per backend, with Nsight Compute.

Prepares the case for each backend exactly as ``ion-bench kernel`` does (same plans, same
caches; ``kernel_runner.prepare_case_backend``), warms every backend up, then runs one
call per backend between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that

    ncu --profile-from-start off --clock-control none --set full -o OUT/prefill \\
        python3 scripts/ncu_prefill.py --case prefill-1x8192-h28/4-d128 \\
        --backends ion-auto-fused,ion-auto-fused-s2,fa3

profiles only those calls (one NVTX range per backend names which kernels are whose).
``scripts/ncu_prefill.sh OUT`` runs that and writes the metrics the notes compare
(duration, tensor-pipe and MUFU utilization, issue-slot use, warp stall reasons) as CSV.
Without ncu the script still runs the calls (a dry run of the preparation).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="prefill-1x8192-h28/4-d128",
                    help="a kernel-suite case name (ion-bench kernel --list)")
    ap.add_argument("--backends", default="ion-auto-fused,fa3")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per backend first")
    args = ap.parse_args(argv)

    import torch

    from ion_vllm.bench import kernel_runner as kr
    from ion_vllm.bench import kernel_suite

    cases = kernel_suite.all_cases()
    if args.case not in cases:
        ap.error(f"unknown case {args.case!r}")
    case = cases[args.case]
    dev = torch.device("cuda")
    calls = {}
    for be in [b for b in args.backends.split(",") if b]:
        preps, _ = kr.prepare_case_backend(case, be, dev)
        calls[be] = preps[0].call
    for _ in range(args.warmup):
        for call in calls.values():
            call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for be, call in calls.items():
        torch.cuda.nvtx.range_push(be)
        call()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    print("profiled:", ",".join(calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
