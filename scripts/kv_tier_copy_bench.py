#!/usr/bin/env python
"""Copy-path micro-benchmark: the Ion KV tier worker against vLLM's native CPU offloading
worker, on the same KV blocks, the same store jobs and the same load jobs.

Why: in the sixth session's reuse benchmark Ion's direct GPU->host copies measured
45 GB/s (ring off, `ion-noring`) against native's 52.5 GB/s for the same bytes
(bench/notes.md, "Sixth session").  This isolates the copy path from the scheduler.

Per worker (`ion`: Ion worker with its defaults, `ion-cegather`: its GPU -> ring gather
on the copy engines (ring_gather="copier", the default before the seventh session),
`ion-noring`: ring_mib 0, `-tensor`: either with host_layout="tensor", `native`:
vllm.v1.kv_offload.cpu.gpu_worker.CPUOffloadingWorker), in interleaved rounds:
  1. stores: J jobs of B random GPU blocks each are submitted back to back, then the
     worker is polled until all are finished; the wall time from the first submit to
     the end of the last device copy gives the D2H GB/s, and the sum of per-job device
     times (TransferResult.transfer_time) the per-job rate;
  2. check: every stored block's host bytes equal the GPU source (any mismatch fails);
  3. loads: the same blocks back into other GPU blocks, timed the same way (H2D), and
     checked byte for byte against the sources.

GPU block ids come in consecutive runs per job by default (`--ids random` to scatter
them): native keeps one host tensor per KV tensor, so a run of consecutive blocks is
contiguous on both sides of its copies, while Ion's host slot holds all tensors of one
block, so consecutive blocks of one tensor are a slot apart on the host.  Whether the
driver turns contiguous neighbours into larger DMA transfers is one of the things this
measures.

Shape defaults: the demo model (Qwen2.5-7B: 28 layers, 4 KV heads, d 128, bf16) with
64-token pages: one block is 28 x 128 KiB = 3.5 MiB, as in the reuse benchmark.

    python3 scripts/kv_tier_copy_bench.py --out bench/results/<dir> [--workers ion,native]

On a machine without CUDA only the Ion worker runs (torch copier, CPU "device"): that
is what the CPU tests exercise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

WORKERS = ("ion", "ion-cegather", "ion-noring", "ion-tensor", "ion-noring-tensor", "native")


def plan_jobs(num_gpu_blocks: int, jobs: int, blocks_per_job: int, seed: int,
              ids: str = "runs") -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Store sources, host destinations and load destinations of ``jobs`` jobs:
    distinct GPU blocks for the stores, consecutive host ids (how both workers' managers
    hand them out), and load targets among the GPU blocks no store uses.  ``ids``:
    "runs" (each job's GPU blocks consecutive, jobs in random order: what vLLM's block
    pool hands a prefill) or "random" (every GPU block id drawn at random)."""
    n = jobs * blocks_per_job
    if 2 * n > num_gpu_blocks:
        raise ValueError(f"need {2 * n} GPU blocks for {jobs} x {blocks_per_job} stores "
                         f"plus their loads, have {num_gpu_blocks}")
    rng = np.random.default_rng(seed)
    if ids == "random":
        perm = rng.permutation(num_gpu_blocks)
    elif ids == "runs":
        runs = num_gpu_blocks // blocks_per_job
        order = rng.permutation(runs)
        perm = (order[:, None] * blocks_per_job + np.arange(blocks_per_job)).reshape(-1)
    else:
        raise ValueError(f"ids must be 'runs' or 'random', not {ids!r}")
    src, dst = perm[:n], perm[n:2 * n]
    cut = lambda a: [a[i:i + blocks_per_job].tolist()  # noqa: E731
                     for i in range(0, n, blocks_per_job)]
    return cut(src), cut(np.arange(n)), cut(dst)


def make_caches(layers: int, num_blocks: int, hkv: int, page: int, head_dim: int,
                device: str, seed: int) -> list[torch.Tensor]:
    """Per-layer KV caches in the ION layout [num_blocks, 2, Hkv, page, d], bf16,
    random (never zeros)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn((num_blocks, 2, hkv, page, head_dim), generator=g)
            .to(torch.bfloat16).to(device) for _ in range(layers)]


def build_worker(name: str, canonical, num_host_blocks: int, ring_mib: float):
    if name == "native":
        from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

        return CPUOffloadingWorker(canonical, blocks_per_chunk=1, num_cpu_blocks=num_host_blocks)
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    ring = 0 if name.startswith("ion-noring") else int(ring_mib * (1 << 20))
    return IonKVTierWorker(canonical, num_host_blocks=num_host_blocks, ring_bytes=ring,
                           log_interval_s=0,
                           host_layout="tensor" if name.endswith("-tensor") else "slot",
                           ring_gather="copier" if name == "ion-cegather" else "auto")


def host_block(worker, canonical, host_id: int) -> list[torch.Tensor]:
    """The host bytes of one block, per canonical tensor (either worker's layout)."""
    if hasattr(worker, "host"):  # Ion: the copier knows its host layout
        return [worker.copier.view(worker.host, t)[host_id]
                for t in range(len(canonical.tensors))]
    return [t[host_id] for t in worker._store_handler.dst_tensors]


def _drain(worker, ids: set[int]) -> dict[int, tuple[int, float]]:
    got: dict[int, tuple[int, float]] = {}
    while len(got) < len(ids):
        for r in worker.get_finished():
            assert r.success, f"job {r.job_id} failed"
            got[r.job_id] = (r.transfer_size or 0, r.transfer_time or 0.0)
    return got


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_round(worker, canonical, plan, device: str, job0: int) -> dict:
    """One store pass and one load pass on ``worker``; returns rates and checks."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    if hasattr(worker, "host"):
        from ion_vllm.kv_tier.manager import IonHostSpec as hspec
    else:
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec as hspec

    src, host, dst = plan
    block_bytes = sum(c.page_size_bytes for c in canonical.tensors)
    nbytes = sum(len(j) for j in src) * block_bytes
    spec = lambda ids: GPULoadStoreSpec(ids, [len(ids)], [0])  # noqa: E731
    out: dict = {}
    for kind, pairs in (("store", zip(src, host)), ("load", zip(host, dst))):
        ids = set()
        _sync(device)
        t0 = time.perf_counter()
        for k, (a, b) in enumerate(pairs):
            jid = job0 + k + (0 if kind == "store" else len(src))
            ids.add(jid)
            if kind == "store":
                worker.submit_store(jid, spec(a), hspec(b))
            else:
                worker.submit_load(jid, hspec(a), spec(b))
        got = _drain(worker, ids)
        _sync(device)  # every copy (an Ion ring drain may end after its job was reported)
        wall = time.perf_counter() - t0
        dev = sum(t for _, t in got.values())
        out[kind] = {"wall_gbps": nbytes / wall / 1e9, "jobs": len(ids),
                     "per_job_gbps": (sum(s for s, _ in got.values()) / dev / 1e9
                                      if dev > 0 else None)}
    # checks: host bytes == GPU source; loaded GPU blocks == GPU source
    rows = [c.tensor for c in canonical.tensors]
    bad_host = bad_load = 0
    for js, jh, jd in zip(src, host, dst):
        for g, h, d in zip(js, jh, jd):
            hb = host_block(worker, canonical, h)
            bad_host += any(not torch.equal(r[g, :c.page_size_bytes].cpu(), x)
                            for r, c, x in zip(rows, canonical.tensors, hb))
            bad_load += any(not torch.equal(r[g], r[d]) for r in rows)
    out["bad_host_blocks"], out["bad_loaded_blocks"] = bad_host, bad_load
    return out


def run(args) -> dict:
    from ion_vllm.kv_tier.worker import canonicalize_layer_caches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    workers = [w for w in args.workers.split(",") if w]
    for w in workers:
        if w not in WORKERS:
            raise SystemExit(f"unknown worker {w!r} (choose from {', '.join(WORKERS)})")
    if device == "cpu" and "native" in workers:
        raise SystemExit("the native worker needs CUDA")
    caches = make_caches(args.layers, args.num_gpu_blocks, args.kv_heads, args.page,
                         args.head_dim, device, args.seed)
    canonical = canonicalize_layer_caches(caches, args.num_gpu_blocks)
    n_host = args.jobs * args.blocks_per_job
    built = {w: build_worker(w, canonical, n_host, args.ring_mib) for w in workers}
    block_bytes = sum(c.page_size_bytes for c in canonical.tensors)
    rounds: list[dict] = []
    for r in range(args.rounds):
        plan = plan_jobs(args.num_gpu_blocks, args.jobs, args.blocks_per_job, args.seed + r,
                         args.ids)
        for w in workers:  # interleaved: w0 v0 w1 v1 ...
            res = run_round(built[w], canonical, plan, device, job0=r * 10 * n_host)
            rounds.append({"worker": w, "round": r, **res})
    for w in built.values():
        w.shutdown()
    summary = {}
    for w in workers:
        rs = [x for x in rounds if x["worker"] == w]
        summary[w] = {f"{k}_wall_gbps_median": statistics.median(x[k]["wall_gbps"] for x in rs)
                      for k in ("store", "load")}
        summary[w]["bad_blocks"] = sum(x["bad_host_blocks"] + x["bad_loaded_blocks"]
                                       for x in rs)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "block_bytes": block_bytes, "tensors": len(canonical.tensors),
            "args": vars(args), "rounds": rounds, "summary": summary}


def table(res: dict) -> list[str]:
    lines = [f"# KV tier copy paths ({res['device']})", "",
             f"{res['args']['jobs']} jobs x {res['args']['blocks_per_job']} blocks of "
             f"{res['block_bytes'] / 2**20:.2f} MiB ({res['tensors']} tensors), "
             f"GPU block ids: {res['args']['ids']}, "
             f"{res['args']['rounds']} interleaved rounds; medians", "",
             "| worker | D2H GB/s (wall) | H2D GB/s (wall) | bad blocks |",
             "|---|---|---|---|"]
    for w, s in res["summary"].items():
        lines.append(f"| {w} | {s['store_wall_gbps_median']:.2f} | "
                     f"{s['load_wall_gbps_median']:.2f} | {s['bad_blocks']} |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="ion,ion-cegather,ion-noring,native")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=32)
    p.add_argument("--blocks-per-job", type=int, default=16)
    p.add_argument("--ring-mib", type=float, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ids", choices=("runs", "random"), default="runs",
                   help="GPU block ids of a job: consecutive runs (default) or random; "
                        "with runs, native's per-tensor host rows are contiguous across "
                        "blocks as the GPU source is, Ion's block-major host slots are not")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    lines = table(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "copy_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "copy_bench.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    bad = sum(s["bad_blocks"] for s in res["summary"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
