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

On the H100 (thirty-first session) the torch graph showed nothing: +0.010 us a kernel.
Its adds each wait for the one before, so no kernel starts before the last one ends. In
vLLM's decode graphs most kernels do start early, it seems through programmatic
dependent launch (PDL). So ``--graphs torch,pdl,plain`` also captures, before any side
work, two graphs of the same adds written in Triton (``_add_kernel``): ``pdl``, launched
with PDL (``launch_pdl``; each kernel waits for its predecessor's memory with
``griddepcontrol.wait`` and lets its dependent launch after its loads with
``griddepcontrol.launch_dependents``), and ``plain``, the same kernel without PDL. Every
read replays every graph. If a side-stream kernel costs the early launch, ``pdl`` loses
time after it, and ``plain`` and ``torch`` do not. On the H200 (thirty-second session)
it did not: PDL saved 0.405 us a kernel (2.273 against 2.678), and kept it after the
side-stream kernel (-0.002 us).

    python3 scripts/side_stream_probe.py --out OUT   # writes OUT/side_stream_probe.{json,md}
    python3 scripts/side_stream_probe.py --graphs torch,pdl,plain --out OUT

Needs a CUDA GPU and torch (Triton for ``pdl`` / ``plain``; PDL needs sm_90 or newer); no
vLLM."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys


#: the graphs the probe can capture (``--graphs``): PyTorch's adds, and the Triton add with
#: and without programmatic dependent launch
GRAPHS = ("torch", "pdl", "plain")


def parse_graphs(text: str) -> list[str]:
    """``--graphs``'s comma list, checked against GRAPHS (a ValueError naming the bad one)."""
    names = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in names if g not in GRAPHS]
    if bad or not names:
        raise ValueError(f"--graphs: {bad or text!r} not among {', '.join(GRAPHS)}")
    return names


def report_lines(rows: list[dict]) -> list[str]:
    """The markdown table of the probe's reads (``rows``: ``state``, ``us_per_kernel``,
    ``p10`` / ``p90`` over the replays, and ``graph``, "torch" where absent), with each
    read's difference from the same graph's ``base``."""
    base = {r.get("graph", "torch"): r["us_per_kernel"] for r in rows if r["state"] == "base"}
    out = ["| graph | state | us a kernel (median) | p10 | p90 | minus base |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("graph", "torch")
        d = "-" if g not in base else f"{r['us_per_kernel'] - base[g]:+.3f}"
        out.append(f"| {g} | {r['state']} | {r['us_per_kernel']:.3f} | {r['p10']:.3f} | "
                   f"{r['p90']:.3f} | {d} |")
    return out


@functools.cache
def _add_kernel_fn():
    """The Triton add of the ``pdl`` / ``plain`` graphs (imported late: the CPU tests and
    the torch graph need no Triton), built once."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_wait()  # the predecessor's writes (a_ptr) are visible after this
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(a_ptr + offs, mask=m)
        b = tl.load(b_ptr + offs, mask=m)
        if PDL:
            gdc_launch_dependents()  # the next kernel may start its prologue now
        tl.store(out_ptr + offs, a + b, mask=m)

    return _add_kernel


#: elements per program of the Triton add
ADD_BLOCK = 4096


def triton_grid(n: int) -> int:
    """Programs of the Triton add over ``n`` elements."""
    return (n + ADD_BLOCK - 1) // ADD_BLOCK


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=2000, help="kernels in the graph")
    ap.add_argument("--reps", type=int, default=50, help="timed replays per read")
    ap.add_argument("--graphs", default="torch",
                    help=f"comma list of graphs to capture and read, of {', '.join(GRAPHS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        names = parse_graphs(args.graphs)
    except ValueError as e:
        ap.error(str(e))

    import torch

    if not torch.cuda.is_available():
        print("side_stream_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    if "pdl" in names and torch.cuda.get_device_capability() < (9, 0):
        print("side_stream_probe: the pdl graph needs sm_90 or newer (programmatic "
              "dependent launch)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    n = 1 << 20
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, device=dev, dtype=torch.bfloat16)
    # the Triton chains add small integers in float32, so that their sum is exact and
    # checked for equality: an add that read its input before the last one wrote it
    # (a PDL chain without its wait) would show
    xi = torch.randint(-64, 64, (n,), device=dev).float()
    yi = torch.randint(-4, 5, (n,), device=dev).float()
    bufs = [torch.empty_like(xi), torch.empty_like(xi)]

    def torch_chain():
        z = x + y
        for _ in range(args.kernels - 1):
            z = z + y

    def triton_chain(pdl: bool):
        add = _add_kernel_fn()
        grid = (triton_grid(n),)
        add[grid](xi, yi, bufs[0], n, BLOCK=ADD_BLOCK, PDL=pdl, launch_pdl=pdl)
        for i in range(args.kernels - 1):  # ping-pong: each add reads the last one's output
            add[grid](bufs[i % 2], yi, bufs[(i + 1) % 2], n, BLOCK=ADD_BLOCK, PDL=pdl,
                      launch_pdl=pdl)

    chains = {"torch": torch_chain, "pdl": lambda: triton_chain(True),
              "plain": lambda: triton_chain(False)}
    graphs = {}
    for name in names:
        chains[name]()  # warm up (and compile) on the current stream: until the side work
        torch.cuda.synchronize()  # below, every kernel of the process runs on this stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chains[name]()
        torch.cuda.synchronize()
        graphs[name] = g
    ref = xi + args.kernels * yi  # the Triton chains' exact result
    for name in names:
        if name == "torch":
            continue
        bufs[0].fill_(float("nan"))  # poisoned before each graph's check
        bufs[1].fill_(float("nan"))
        graphs[name].replay()
        torch.cuda.synchronize()
        wrong = int((bufs[(args.kernels - 1) % 2] != ref).sum())
        if wrong:
            print(f"side_stream_probe: the {name} graph computed a wrong sum in {wrong} "
                  f"of {n} elements", file=sys.stderr)
            return 1

    def read(state: str) -> list[dict]:
        rows = []
        for name, g in graphs.items():
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.reps):
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) * 1e3 / args.kernels)
            rows.append({"graph": name, "state": state,
                         "us_per_kernel": statistics.median(times),
                         "p10": _quantile(times, 0.1), "p90": _quantile(times, 0.9)})
        return rows

    rows = read("base")
    side = torch.cuda.Stream()
    host = torch.empty(1 << 20, dtype=torch.bfloat16, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)  # a copy-engine copy, no kernel
    torch.cuda.synchronize()
    rows += read("after-copy")
    with torch.cuda.stream(side):
        w = x * 2  # one small kernel on the second stream
    del w
    torch.cuda.synchronize()
    rows += read("after-kernel")
    rows += read("after-kernel-again")

    lines = [f"# Side-stream probe ({torch.cuda.get_device_name()}, {args.kernels} kernels, "
             f"{args.reps} replays a read)", ""] + report_lines(rows)
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "side_stream_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "kernels": args.kernels,
                       "reps": args.reps, "graphs": names, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "side_stream_probe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
