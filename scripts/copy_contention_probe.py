#!/usr/bin/env python
"""Does a KV-tier bulk copy delay the engine's own small per-step copies?

vLLM copies a little every engine step: the step's inputs host -> GPU on the compute
stream (ids, positions, slot mapping, block table rows), and the sampled token ids
GPU -> host on a side stream.  The KV tier moves megabytes over the same PCIe link on
its own streams: drains (ring -> host, GPU -> host) and loads (host -> GPU).  If a
small copy queues on a copy engine behind a bulk one, the step waits for the bulk
copy: its inputs arrive late (the GPU idles) or its tokens do (the host schedules the
next step late).

This probe measures it: while a bulk copy of ``--bulk-mib`` runs on a low-priority side
stream, small probe copies are issued back to back on another stream, and each one's
latency is timed with CUDA events (event on the idle probe stream, copy, event).  A
probe counts when it was issued before the bulk copy ended; its latency then includes
any wait behind the bulk copy.  Bulk modes:

* ``none``: the probes alone (their floor);
* ``<dir>-one``: one ``cudaMemcpyAsync`` of the whole bulk (the tier's ring drain of a
  run of slots);
* ``<dir>-chunks-<K>``: the same bytes as copies of ``K`` KiB, all enqueued at once;
* ``<dir>-batch-<K>``: the same pieces in one driver call (vLLM's ``swap_blocks_batch``,
  ``cuMemcpyBatchAsync``; needs vLLM): the KV tier's chunked drain (``drain_chunk_kib``);
* ``<dir>-paced-<K>-<W>``: copies of ``K`` KiB issued by a host thread with at most
  ``W`` of them outstanding (the next one after the oldest one's event);
* ``<dir>-sm-<G>``: no copy engine at all: ``G`` Triton programs copy the bulk to or
  from the pinned host buffer through its unified address (SM stores or loads over
  PCIe);

with ``<dir>`` = ``d2h`` or ``h2d``; and

* ``gated-<dir>-<MS>``: no bulk at all: one 64 KiB copy on the bulk stream that first
  waits for an event behind a GPU spin of ``MS`` ms on a third stream (the compute
  stream's step).  This is the KV tier's ring piece: its block-id copy (host -> GPU)
  waits for the compute stream before it can start.  If the probes wait ~``MS`` ms too,
  a copy blocked on another stream's event holds up every later copy of its direction,
  and the engine's next-step input copies queue behind the tier's id copies.

Probes: ``d2h-4k`` (sampled tokens) and
``h2d-64k`` (step inputs, followed by a one-element kernel on the same stream, as the
step's first kernel would be).  For each pair it reports the probes' median / p90
latency during the bulk copy (host clock: issue to completion), the bulk's own GB/s,
and how much the bulk slows a memory-bound kernel on another stream (SM modes take
SMs; copy-engine modes take only HBM bandwidth).

    python3 scripts/copy_contention_probe.py --out OUT   # writes OUT/probe.{json,md}

Needs a CUDA GPU, torch and Triton; no vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the probe's SM mode needs Triton
    triton = None


if triton is not None:

    @triton.jit
    def _sm_copy_kernel(src, dst, nwords, WORDS: tl.constexpr):
        """Program p copies blocks p, p + G, ... of WORDS int64 words from src to dst
        (raw addresses: dst may be pinned host memory)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        s = src.to(tl.pointer_type(tl.int64))
        d = dst.to(tl.pointer_type(tl.int64))
        offs = tl.arange(0, WORDS)
        nblk = tl.cdiv(nwords, WORDS)
        for b in range(pid, nblk, nprog):
            o = b * WORDS + offs
            m = o < nwords
            tl.store(d + o, tl.load(s + o, mask=m), mask=m)


def sm_copy(src: torch.Tensor, dst: torch.Tensor, programs: int) -> None:
    assert src.numel() == dst.numel() and src.dtype == dst.dtype == torch.int8
    nwords = src.numel() // 8
    _sm_copy_kernel[(programs,)](src.data_ptr(), dst.data_ptr(), nwords, WORDS=2048,
                                 num_warps=4)


def batch_pieces(src_ptr: int, dst_ptr: int, nbytes: int, step: int):
    """(src, dst, sizes) int64 tensors of ``nbytes`` cut into copies of ``step`` bytes:
    the KV tier drain's own chunking (``raw_issue.chunked``)."""
    from ion_vllm.kv_tier.raw_issue import chunked

    dst, src, sizes = chunked([(dst_ptr, src_ptr, nbytes)], step)
    return torch.from_numpy(src), torch.from_numpy(dst), torch.from_numpy(sizes)


def batch_copy(src: torch.Tensor, dst: torch.Tensor, step: int) -> None:
    """The bulk as copies of ``step`` bytes in one driver call (vLLM's swap_blocks_batch,
    cuMemcpyBatchAsync: how the tier's chunked drain issues them) on the current stream."""
    from vllm import _custom_ops as ops

    s, d, z = batch_pieces(src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size(),
                           step)
    ops.swap_blocks_batch(s, d, z)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Bench:
    def __init__(self, bulk_bytes: int, probe_priority: int = 0):
        dev = torch.device("cuda")
        self.n = bulk_bytes
        # random bytes, never zeros: a copy engine or a kernel cannot shortcut them
        self.gpu_src = torch.randint(-128, 127, (bulk_bytes,), dtype=torch.int8, device=dev)
        self.gpu_dst = torch.empty_like(self.gpu_src)
        self.host = torch.empty(bulk_bytes, dtype=torch.int8, pin_memory=True)
        self.host.copy_(self.gpu_src.cpu())
        self.bulk_stream = torch.cuda.Stream(priority=0)  # low priority (PyTorch: 0 is lowest)
        self.probe_stream = torch.cuda.Stream(priority=probe_priority)
        self.p_d2h_src = torch.randint(0, 1 << 30, (1024,), dtype=torch.int32, device=dev)
        self.p_d2h_dst = torch.empty(1024, dtype=torch.int32, pin_memory=True)
        self.p_h2d_src = torch.randint(0, 1 << 30, (16384,), dtype=torch.int32).pin_memory()
        self.p_h2d_dst = torch.empty(16384, dtype=torch.int32, device=dev)
        self._work_src = torch.randn(1 << 28, device=dev)  # 1 GiB
        self._work_dst = torch.empty_like(self._work_src)
        self.gate_stream = torch.cuda.Stream(priority=0)
        self.g_host = torch.randint(0, 1 << 30, (16384,), dtype=torch.int32).pin_memory()
        self.g_dev = torch.randint(0, 1 << 30, (16384,), dtype=torch.int32, device=dev)
        self._cycles_per_ms: float | None = None

    def cycles_per_ms(self) -> float:
        """GPU clock cycles per ms of ``torch.cuda._sleep``, measured once (events)."""
        if self._cycles_per_ms is None:
            n = 2_000_000
            torch.cuda._sleep(n)  # warm
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.cuda._sleep(n)
            e1.record()
            e1.synchronize()
            self._cycles_per_ms = n / e0.elapsed_time(e1)
        return self._cycles_per_ms

    def issue_gated(self, d2h: bool, ms: float) -> None:
        """A 64 KiB copy on the bulk stream, ordered after a GPU spin of ``ms`` ms on the
        gate stream (an event wait, as the tier orders its copies after the compute
        stream)."""
        with torch.cuda.stream(self.gate_stream):
            torch.cuda._sleep(int(ms * self.cycles_per_ms()))
        gate = torch.cuda.Event()
        gate.record(self.gate_stream)
        self.bulk_stream.wait_event(gate)
        with torch.cuda.stream(self.bulk_stream):
            if d2h:
                self.g_host.copy_(self.g_dev, non_blocking=True)
            else:
                self.g_dev.copy_(self.g_host, non_blocking=True)

    # ------------------------------------------------------------------ bulk
    def issue_bulk(self, mode: str) -> threading.Thread | None:
        """Enqueue mode's bulk copy on the bulk stream.  Returns at once, except for a
        paced mode, which returns its running pacer thread (join it: the bulk copy has
        then been issued completely)."""
        if mode == "none":
            return None
        parts = mode.split("-")
        if parts[0] == "gated":
            self.issue_gated(parts[1] == "d2h", float(parts[2]))
            return None
        d2h = parts[0] == "d2h"
        src, dst = (self.gpu_src, self.host) if d2h else (self.host, self.gpu_dst)
        if parts[1] == "paced":
            th = threading.Thread(target=self._paced, args=(
                src, dst, int(parts[2]) << 10, int(parts[3])), daemon=True)
            th.start()
            return th
        with torch.cuda.stream(self.bulk_stream):
            if parts[1] == "sm":
                sm_copy(src, dst, int(parts[2]))
            elif parts[1] == "one":
                dst.copy_(src, non_blocking=True)
            elif parts[1] == "batch":
                batch_copy(src, dst, int(parts[2]) << 10)
            else:
                step = int(parts[2]) << 10
                for a in range(0, self.n, step):
                    dst[a:a + step].copy_(src[a:a + step], non_blocking=True)
        return None

    def _paced(self, src, dst, step: int, window: int) -> None:
        pending: list[torch.cuda.Event] = []
        with torch.cuda.stream(self.bulk_stream):
            for a in range(0, self.n, step):
                if len(pending) >= window:
                    pending.pop(0).synchronize()
                dst[a:a + step].copy_(src[a:a + step], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.bulk_stream)
                pending.append(ev)

    def bulk_gbps(self, mode: str, reps: int = 3) -> float:
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(self.bulk_stream)
            th = self.issue_bulk(mode)
            if th is not None:
                th.join()
            e1.record(self.bulk_stream)
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        return self.n / statistics.median(ts) / 1e9

    # ----------------------------------------------------------------- probes
    def probe_once(self, probe: str) -> tuple[float, float]:
        """One probe copy on the probe stream: (host µs from issue to completion, event µs
        from an event recorded on the probe stream just before it to one just after).
        The host time is the one that counts: when the probe stream's own commands queue
        behind the bulk copy, the first event is stamped late too and hides the wait."""
        s = self.probe_stream
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            e0.record(s)
            if probe == "d2h-4k":
                self.p_d2h_dst.copy_(self.p_d2h_src, non_blocking=True)
            else:  # h2d-64k, then the step's first kernel
                self.p_h2d_dst.copy_(self.p_h2d_src, non_blocking=True)
                self.p_h2d_dst[:1].add_(1)
            e1.record(s)
        e1.synchronize()
        return (time.perf_counter() - t0) * 1e6, e0.elapsed_time(e1) * 1e3

    def probe_during(self, mode: str, probe: str, min_probes: int = 40) -> dict:
        """Latencies of probes issued while mode's bulk copy was in flight (bulk copies
        repeated until min_probes were taken; for mode none, min_probes probes alone).
        ``first_*``: the first probe of each bulk copy, issued ~20 µs after it."""
        host: list[float] = []
        ev: list[float] = []
        first: list[float] = []
        rounds = 0
        while len(host) < min_probes and rounds < 60:
            rounds += 1
            torch.cuda.synchronize()
            th = self.issue_bulk(mode)
            time.sleep(20e-6)
            k = 0
            while True:
                if mode != "none":
                    # in flight: a paced bulk whose pacer still runs, or work queued
                    busy = (th is not None and th.is_alive()) or not self.bulk_stream.query()
                    if not busy:
                        break
                h, e = self.probe_once(probe)
                host.append(h)
                ev.append(e)
                if k == 0:
                    first.append(h)
                k += 1
                if mode == "none" and len(host) >= min_probes:
                    break
            if th is not None:
                th.join()
        torch.cuda.synchronize()
        if not host:
            return {"n": 0, "median_us": None, "p90_us": None, "max_us": None,
                    "first_median_us": None, "event_median_us": None}
        return {"n": len(host), "median_us": statistics.median(host),
                "p90_us": pct(host, 0.9), "max_us": max(host),
                "first_median_us": statistics.median(first),
                "event_median_us": statistics.median(ev)}

    def compute_slowdown(self, mode: str, reps: int = 5) -> float | None:
        """Time of a memory-bound kernel (a 1 GiB device copy) on the compute stream
        while mode's bulk copy runs, over its time alone (median of reps)."""
        if mode == "none":
            return None
        x = self._work_src
        y = self._work_dst

        def timed() -> float:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            y.copy_(x)
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1)

        alone, busy = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            alone.append(timed())
            th = self.issue_bulk(mode)
            time.sleep(200e-6)
            busy.append(timed())
            if th is not None:
                th.join()
            torch.cuda.synchronize()
        return statistics.median(busy) / statistics.median(alone)


def _d2h_mismatch(b: Bench, copy) -> float:
    """Share of mismatching bytes (0 expected) after ``copy()`` moved the bulk GPU ->
    host, every byte compared against its source (destination poisoned first)."""
    b.host.fill_(0x5A)
    torch.cuda.synchronize()
    copy()
    torch.cuda.synchronize()
    return (b.host != b.gpu_src.cpu()).sum().item() / b.n


def check_batch_copy(b: Bench, mode: str) -> float:
    """``_d2h_mismatch`` of the batched GPU -> host copy of ``mode``."""
    def copy():
        with torch.cuda.stream(b.bulk_stream):
            batch_copy(b.gpu_src, b.host, int(mode.split("-")[2]) << 10)
    return _d2h_mismatch(b, copy)


def check_sm_copy(b: Bench, mode: str) -> float:
    """Share of mismatching bytes (0 expected) after the SM copy of ``mode``, every byte
    compared against its source (destination poisoned first)."""
    programs = int(mode.split("-")[2])
    if mode.startswith("d2h"):
        return _d2h_mismatch(b, lambda: sm_copy(b.gpu_src, b.host, programs))
    b.host.copy_(torch.randint(-128, 127, (b.n,), dtype=torch.int8))
    b.gpu_dst.fill_(0x5A)
    sm_copy(b.host, b.gpu_dst, programs)
    torch.cuda.synchronize()
    return (b.gpu_dst.cpu() != b.host).sum().item() / b.n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bulk-mib", type=int, default=256)
    ap.add_argument("--modes", default="none,d2h-one,d2h-chunks-4096,d2h-chunks-1024,"
                    "d2h-paced-4096-2,d2h-paced-2048-2,d2h-sm-8,d2h-sm-16,h2d-one,"
                    "h2d-chunks-4096,h2d-paced-4096-2,h2d-paced-2048-2,h2d-sm-8,h2d-sm-16,"
                    "h2d-sm-32")
    ap.add_argument("--probes", default="d2h-4k,h2d-64k")
    ap.add_argument("--probe-priority", type=int, default=0,
                    help="CUDA priority of the probe stream (negative: higher)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    b = Bench(args.bulk_mib << 20, args.probe_priority)
    for m in args.modes.split(","):  # warm every path (Triton compile, allocator)
        th = b.issue_bulk(m)
        if th is not None:
            th.join()
    for p in args.probes.split(","):
        b.probe_once(p)
    torch.cuda.synchronize()
    checks = {m: check_sm_copy(b, m) for m in args.modes.split(",") if "-sm-" in m}
    checks.update({m: check_batch_copy(b, m) for m in args.modes.split(",")
                   if m.startswith("d2h-batch-")})
    rows = []
    for m in args.modes.split(","):
        no_bulk = m == "none" or m.startswith("gated-")  # a gated copy is 64 KiB
        row = {"mode": m, "bulk_gbps": None if no_bulk else b.bulk_gbps(m),
               "compute_slowdown": None if no_bulk else b.compute_slowdown(m)}
        for p in args.probes.split(","):
            row[p] = b.probe_during(m, p)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "bulk_mib": args.bulk_mib, "copy_mismatch_frac": checks,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
            "probe_priority": args.probe_priority,
            "argv": sys.argv}
    with open(os.path.join(args.out, "probe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    probes = args.probes.split(",")
    conns = meta["cuda_device_max_connections"] or "default"
    lines = [f"# Copy contention probe ({meta['device']}, bulk {args.bulk_mib} MiB, "
             f"CUDA_DEVICE_MAX_CONNECTIONS={conns}, probe stream priority "
             f"{args.probe_priority})", "",
             "| bulk mode | bulk GB/s | compute slowdown | " + " | ".join(
                 f"{p} median / p90 / first µs (n)" for p in probes) + " |",
             "|---|---|---|" + "---|" * len(probes)]
    for r in rows:
        cells = []
        for p in probes:
            x = r[p]
            cells.append("-" if x["median_us"] is None else
                         f"{x['median_us']:.1f} / {x['p90_us']:.1f} / "
                         f"{x['first_median_us']:.1f} ({x['n']})")
        g = "-" if r["bulk_gbps"] is None else f"{r['bulk_gbps']:.1f}"
        c = "-" if r["compute_slowdown"] is None else f"{r['compute_slowdown']:.3f}"
        lines.append(f"| {r['mode']} | {g} | {c} | " + " | ".join(cells) + " |")
    lines += ["", "Latencies on the host clock, issue to completion. compute slowdown: a 1 GiB "
              "device copy on the default stream, time during the bulk / time alone.",
              f"SM copies, mismatching bytes (poisoned destination): {checks}"]
    with open(os.path.join(args.out, "probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
