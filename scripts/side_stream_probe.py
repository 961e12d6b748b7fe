#!/usr/bin/env python
"""Does a kernel run once on a second stream slow every later CUDA-graph replay?

The thirtieth session's profiles (bench/results/2026-12-06-h100/session30/) found that,
once the vLLM process had run a kernel on a stream other than its compute stream (the KV
tier's ring gather, or its SM load kernel), every kernel boundary inside the decode steps'
CUDA graphs idled ~0.4 us longer for the rest of the run. Processes that had only put
copy-engine copies on other streams kept the shorter boundaries. PyTorch issue #161104
reports a similar lasting cost in a chain of small adds. This probe checks the reading
without vLLM, in one fresh process, in this order:

1. ``base``: a CUDA graph of ``--kernels`` small dependent kernels, replayed on the
   current stream; replay time per kernel (CUDA events, median of ``--reps`` replays).
   Until then every kernel of the process has run on that one stream: the tensors are
   made and the warm-up runs there, and capturing runs no kernel.
2. ``after-copy``: the same replays after a device -> host copy ran on a second stream
   (the only kind of side work vLLM's native worker does).
3. ``after-kernel``: the same replays after one small kernel ran on a second stream.
4. ``after-kernel-again``: the same replays a second time, for the noise between two reads
   of one state.

The graph is captured once, before any side work, so it is the same graph in every read.
Its kernels are elementwise adds on a 1 Mi-element bf16 tensor, each a few microseconds,
so that the boundaries weigh as they do in a decode step. If the reading holds,
``after-kernel`` is slower than ``base`` and ``after-copy`` by ~0.2-0.4 us a kernel, and
``after-copy`` equals ``base``. The order is fixed: a kernel's effect, once there, would
last.

    python3 scripts/side_stream_probe.py --out OUT   # writes OUT/side_stream_probe.{json,md}

Needs a CUDA GPU and torch; no vLLM."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def report_lines(rows: list[dict]) -> list[str]:
    """The markdown table of the probe's reads (``rows``: ``state``, ``us_per_kernel``,
    ``p10`` / ``p90`` over the replays), with each read's difference from ``base``."""
    base = next((r["us_per_kernel"] for r in rows if r["state"] == "base"), None)
    out = ["| state | us a kernel (median) | p10 | p90 | minus base |", "|---|---|---|---|---|"]
    for r in rows:
        d = "-" if base is None else f"{r['us_per_kernel'] - base:+.3f}"
        out.append(f"| {r['state']} | {r['us_per_kernel']:.3f} | {r['p10']:.3f} | "
                   f"{r['p90']:.3f} | {d} |")
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=2000, help="kernels in the graph")
    ap.add_argument("--reps", type=int, default=50, help="timed replays per read")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("side_stream_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev, dtype=torch.bfloat16)
    y = torch.randn(1 << 20, device=dev, dtype=torch.bfloat16)
    z = x + y  # warm up on the current stream: until the side work below, every kernel of
    for _ in range(3):  # the process runs on this one stream (the capture runs none)
        z = z + y
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        z = x + y
        for _ in range(args.kernels - 1):
            z = z + y
    torch.cuda.synchronize()

    def read(state: str) -> dict:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3 / args.kernels)
        return {"state": state, "us_per_kernel": statistics.median(times),
                "p10": _quantile(times, 0.1), "p90": _quantile(times, 0.9)}

    rows = [read("base")]
    side = torch.cuda.Stream()
    host = torch.empty(1 << 20, dtype=torch.bfloat16, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)  # a copy-engine copy, no kernel
    torch.cuda.synchronize()
    rows.append(read("after-copy"))
    with torch.cuda.stream(side):
        w = x * 2  # one small kernel on the second stream
    del w
    torch.cuda.synchronize()
    rows.append(read("after-kernel"))
    rows.append(read("after-kernel-again"))

    lines = [f"# Side-stream probe ({torch.cuda.get_device_name()}, {args.kernels} kernels, "
             f"{args.reps} replays a read)", ""] + report_lines(rows)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "side_stream_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "kernels": args.kernels,
                       "reps": args.reps, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "side_stream_probe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
