"""One launch per (case, backend) inside an NVTX range ``ncu``, for Nsight Compute.

Every backend runs once first (compile, warm caches); only the second call, one per
backend, sits inside the range, so ``--nvtx --nvtx-include ncu/`` profiles exactly those:

  ncu --clock-control none --nvtx --nvtx-include ncu/ --set full -o OUT/prof -f \\
      python3 scripts/ncu_case.py --case prefill-1x8192-h16/8-d256 --backends ion-attn,fa3

``--register FILE.py`` adds backends as ``ion-bench kernel --register`` does.
"""

from __future__ import annotations

import argparse
import runpy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True, help="comma-separated ion-bench case names")
    p.add_argument("--backends", required=True, help="comma-separated backend names")
    p.add_argument("--register", action="append", default=[], metavar="FILE.py")
    args = p.parse_args()

    import torch
    from ion_vllm.bench import kernel_runner as kr
    from ion_vllm.bench import kernel_suite

    for f in args.register:
        runpy.run_path(f, run_name="ion_bench_register")  # as ion-bench kernel does
    cases = kernel_suite.select(names=args.case.split(","))
    dev = torch.device("cuda")
    for case in cases:
        for name in args.backends.split(","):
            prep = kr.BACKENDS[name](case, 0, dev, {})
            prep.call()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("ncu")
            prep.call()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"{case.name} {name}: profiled", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
