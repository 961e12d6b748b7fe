#!/usr/bin/env python
"""What does the KV tier's GPU -> ring gather cost the forward pass it runs beside?

The twenty-sixth session found Ion's turn-1 loss on the ring path: the same store jobs
copied GPU -> host directly (`ring_mib=0`) cost nothing, through the ring they made the
engine's steps 1.2% longer while the GPU stayed busy (`bench/notes.md`).  The ring path
adds two things to a store: a gather on the SMs (the worker's own `PageGather` kernel,
on a stream of higher priority than vLLM's compute stream) and a drain of a whole ring
run as one PCIe copy.  This probe measures the first, alone and beside compute:

1. correctness: a gather of random blocks into random ring rows leaves the ring exactly
   as a torch reference does (checked before any timing);
2. the gather alone: µs and GB/s (bytes copied / time) for jobs of ``--blocks`` blocks;
3. beside compute: a compute workload on its own stream, timed alone and with a gather of
   ``--beside`` blocks enqueued right after its first kernel, on a high-priority stream
   and on a normal one.  Workloads: ``prefill`` (bf16 GEMMs of ``--prefill-m`` rows, a
   turn-1 prefill chunk's shape) and ``decode`` (bf16 GEMMs of ``--decode-m`` rows:
   bound by reading the weights, as a decode step is).  Reported: the workload's time
   alone, with each gather, the added time, and that added time over the gather's own
   time alone (1.0: the gather's time is simply added; far above 1: it disturbs the
   compute beyond its own length).

The drain's side (a small GPU -> host copy behind one big copy or behind 128 KiB copies)
is `scripts/copy_contention_probe.py --modes none,d2h-one,d2h-chunks-128`.

    python3 scripts/ring_gather_probe.py --out OUT   # writes OUT/gather.{json,md}

Needs a CUDA GPU, torch and Triton; no vLLM (`page_gather.py` imports neither).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ion_vllm.kv_tier.page_gather import PageGather  # noqa: E402


def slot_placement(page_bytes: list[int]):
    """TorchCopier's "slot" placement: tensor t's page at byte offsets[t] of a ring row."""
    offs = [int(x) for x in np.cumsum([0] + page_bytes[:-1])]

    def placement(buf: torch.Tensor, t: int) -> tuple[int, int]:
        return offs[t], buf.stride(0)
    return placement, offs


def build(num_blocks: int, tensors: int, page_bytes: int, ring_slots: int,
          device: str, seed: int = 0):
    """KV tensors of the ION layout's shape (one int8 [blocks, page] per layer, random
    bytes), a ring of ``ring_slots`` rows and the worker's gather over them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    kv = [torch.randint(-128, 128, (num_blocks, page_bytes), dtype=torch.int8,
                        generator=g).to(device) for _ in range(tensors)]
    pages = [page_bytes] * tensors
    placement, offs = slot_placement(pages)
    ring = torch.zeros((ring_slots, sum(pages)), dtype=torch.int8, device=device)
    gather = PageGather(kv, [[(t, page_bytes) for t in range(tensors)]], placement, ring)
    return kv, ring, gather, offs


def check(kv, ring, gather, offs, rng: np.random.Generator, gather_fn=None) -> bool:
    """A gather of random blocks into random ring rows against a torch reference."""
    n = int(rng.integers(1, min(8, ring.shape[0]) + 1))
    ids = rng.choice(kv[0].shape[0], n, replace=False)
    start = int(rng.integers(0, ring.shape[0] - n + 1))
    ring.fill_(7)
    ref = ring.clone()
    (gather_fn or gather)(ring, start, 0, ids)
    idx = torch.from_numpy(ids.astype(np.int64)).to(ring.device)
    for t, src in enumerate(kv):
        nb = src.shape[1]
        ref[start:start + n, offs[t]:offs[t] + nb] = src.index_select(0, idx)
    if ring.is_cuda:
        torch.cuda.synchronize()
    return bool(torch.equal(ring, ref))


def median_ms(fn, reps: int, stream) -> float:
    """Median device time of ``fn()`` issued on ``stream`` (events on that stream)."""
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            e0.record()
            fn()
            e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


def beside(work, gather_job, reps: int, cs, gs) -> tuple[float, float]:
    """Median ms of ``work`` (a list of kernels-launching callables) on stream ``cs``, with
    ``gather_job`` (or nothing) enqueued on ``gs`` right after the first of them; and the
    median ms of the gather itself there."""
    tw, tg = [], []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(cs):
            ev[0].record()
            work[0]()
        if gather_job is not None:
            with torch.cuda.stream(gs):
                ev[2].record()
                gather_job()
                ev[3].record()
        with torch.cuda.stream(cs):
            for w in work[1:]:
                w()
            ev[1].record()
        torch.cuda.synchronize()
        tw.append(ev[0].elapsed_time(ev[1]))
        if gather_job is not None:
            tg.append(ev[2].elapsed_time(ev[3]))
    return statistics.median(tw), (statistics.median(tg) if tg else 0.0)


def table(res: dict) -> str:
    lines = [f"# Ring gather probe ({res['device']})", "",
             f"{res['tensors']} tensors x {res['page_bytes'] // 1024} KiB pages "
             f"({res['slot_bytes'] / 2**20:.2f} MiB a block); correctness checks passed: "
             f"{res['checks_passed']} of {res['checks']}", "",
             "| blocks | gather alone us | GB/s copied |", "|---|---|---|"]
    for r in res["alone"]:
        lines.append(f"| {r['blocks']} | {r['us']:.1f} | {r['gbps']:.0f} |")
    lines += ["", f"Beside compute (a gather of {res['beside_blocks']} blocks enqueued after "
              "the workload's first kernel):", "",
              "| workload | alone ms | gather priority | with gather ms | added us | "
              "gather there us | added / gather alone |", "|---|---|---|---|---|---|---|"]
    for r in res["beside"]:
        lines.append(f"| {r['workload']} | {r['alone_ms']:.3f} | {r['priority']} | "
                     f"{r['with_ms']:.3f} | {r['added_us']:.1f} | {r['gather_us']:.1f} | "
                     f"{r['added_over_gather']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="1,9,32,73")
    ap.add_argument("--beside", type=int, default=32, help="blocks of the gather beside compute")
    ap.add_argument("--tensors", type=int, default=28, help="KV tensors (layers)")
    ap.add_argument("--page-kib", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=400)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--ffn", type=int, default=18944)
    ap.add_argument("--prefill-m", type=int, default=2048)
    ap.add_argument("--decode-m", type=int, default=32)
    ap.add_argument("--kernels", type=int, default=8, help="GEMMs a workload")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--checks", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    blocks = [int(x) for x in a.blocks.split(",")]
    if not torch.cuda.is_available():
        print("ring_gather_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    ring_slots = max(blocks + [a.beside])
    if a.num_blocks < ring_slots:
        ap.error("--num-blocks must be at least the largest job")
    kv, ring, gather, offs = build(a.num_blocks, a.tensors, a.page_kib * 1024, ring_slots,
                                   "cuda")
    rng = np.random.default_rng(1)
    passed = sum(check(kv, ring, gather, offs, rng) for _ in range(a.checks))
    slot = a.tensors * a.page_kib * 1024
    res = {"device": torch.cuda.get_device_name(), "tensors": a.tensors,
           "page_bytes": a.page_kib * 1024, "slot_bytes": slot, "checks": a.checks,
           "checks_passed": passed, "alone": [], "beside": [], "beside_blocks": a.beside,
           "args": vars(a)}
    if passed != a.checks:
        print(f"ring_gather_probe: {a.checks - passed} gather checks FAILED", file=sys.stderr)
    hi = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    lo = torch.cuda.Stream(priority=0)
    for n in blocks:
        ids = rng.choice(a.num_blocks, n, replace=False)
        ms = median_ms(lambda ids=ids: gather(ring, 0, 0, ids), a.reps, hi)
        res["alone"].append({"blocks": n, "us": ms * 1e3, "gbps": n * slot / (ms * 1e-3) / 1e9})
    ids = rng.choice(a.num_blocks, a.beside, replace=False)
    g_alone = median_ms(lambda: gather(ring, 0, 0, ids), a.reps, hi)
    w = torch.randn(a.hidden, a.ffn, dtype=torch.bfloat16, device="cuda")
    cs = torch.cuda.Stream(priority=0)
    for name, m in (("prefill", a.prefill_m), ("decode", a.decode_m)):
        x = torch.randn(m, a.hidden, dtype=torch.bfloat16, device="cuda")
        work = [lambda x=x: torch.mm(x, w) for _ in range(a.kernels)]
        alone, _ = beside(work, None, a.reps, cs, None)
        for prio, gs in (("high", hi), ("normal", lo)):
            with_ms, g_ms = beside(work, lambda: gather(ring, 0, 0, ids), a.reps, cs, gs)
            added = (with_ms - alone) * 1e3
            res["beside"].append({"workload": name, "m": m, "alone_ms": alone,
                                  "priority": prio, "with_ms": with_ms, "added_us": added,
                                  "gather_us": g_ms * 1e3,
                                  "added_over_gather": added / (g_alone * 1e3)})
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gather.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = table(res)
    with open(os.path.join(a.out, "gather.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if passed == a.checks else 1


if __name__ == "__main__":
    sys.exit(main())
