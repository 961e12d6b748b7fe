#!/usr/bin/env python
"""Host time of the Ion KV tier worker's entry points, without a profiler.

Why: vLLM calls ``submit_store`` / ``submit_load`` before it enqueues a step's forward pass
(``start_load_kv``), so their host time delays that launch, and the GPU idles for it once
the previous step has drained.  A torch-profiler trace of the reuse benchmark put
``submit_store`` at 684 us a call (``bench/results/2026-12-04-h200/session22``), but the
profiler itself records every aten op and CUDA call inside it.  This measures the same
calls with ``time.perf_counter`` only, while a long kernel keeps the compute stream busy
(as a forward pass in flight does, so nothing here waits on the GPU), for both issue
points (``issue_at``: ``submit`` issues the copies inside the submit; ``finish`` records
the job and an event, and the next ``get_finished`` issues it).

Per issue point and job size (blocks): ``reps`` rounds of
  busy kernel -> submit_store(job) [timed] -> get_finished() [timed]
  -> synchronize -> poll until the job is reported -> check the host bytes
then the same for loads of those host blocks into other GPU blocks (checked byte for byte
against the sources).  On CUDA it also times the pieces a ring piece is made of (event
record, stream wait, id upload, gather launch, drain copy), to say where the time goes.
``--breakdown B`` (default 4; 0: off) then runs the store/load rounds once more with jobs of
B blocks and every worker method, runtime call and copy function a job goes through wrapped
in a host clock (``HostClock``): each entry point's time split into the exclusive time of
each part, in the real call sequence rather than one part in a loop (the wrappers add
about a microsecond a call).

    python3 scripts/kv_tier_host_cost.py --out bench/results/<dir>

Without CUDA it runs the same calls on the CPU worker (what the CPU test checks); the
times then mean nothing for a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_tier_copy_bench import host_block, make_caches  # noqa: E402  (same directory)

from ion_vllm.kv_tier.staging_ring import ID_UPLOADS, ISSUE_APIS, ISSUE_POINTS  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _us(xs: list[float]) -> dict:
    return {"median_us": statistics.median(xs) * 1e6, "p90_us": _pct(xs, 0.9) * 1e6,
            "n": len(xs)}


def _busy(device: str, ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (a forward pass in flight)."""
    if device == "cuda" and ms > 0:
        torch.cuda._sleep(int(ms * 1e-3 * _busy.hz))


_busy.hz = 1.5e9  # set from the device's clock in run()


class HostClock:
    """Exclusive host time of wrapped callables, per call of an entry point.

    ``wrap(name, fn)`` returns ``fn`` timed: its time minus that of the wrapped calls it
    makes counts under ``name``.  A wrapped call made when no other is running is an entry
    point: when it returns, the exclusive times of everything under it (itself included)
    are kept as one record of that entry point and the counts start again."""

    def __init__(self):
        self.excl: dict[str, float] = {}
        self.stack: list[float] = []  # time of finished wrapped children, per open call
        self.records: dict[str, list[dict[str, float]]] = {}
        self.recording = True  # off: entry points are timed but not kept
        self.tag: str | None = None  # the key of the next records, instead of the entry name

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                child = self.stack.pop()
                self.excl[name] = self.excl.get(name, 0.0) + dt - child
                if self.stack:
                    self.stack[-1] += dt
                else:
                    if self.recording:
                        self.records.setdefault(self.tag or name, []).append(self.excl)
                    self.excl = {}
        return timed

    def summary(self) -> dict:
        """entry point -> {"calls", "total_us" (median), "parts" {name: median us}}, the
        parts in decreasing order (a part absent from a call counts 0 there)."""
        out = {}
        for entry, recs in self.records.items():
            names = {k for r in recs for k in r}
            med = {k: statistics.median([r.get(k, 0.0) for r in recs]) * 1e6 for k in names}
            out[entry] = {"calls": len(recs),
                          "total_us": statistics.median([sum(r.values()) for r in recs]) * 1e6,
                          "parts": dict(sorted(med.items(), key=lambda kv: -kv[1]))}
        return out


#: what a store or load job goes through, by owner: the worker's methods, its runtime's
#: stream/event calls, its copy functions (instance attributes), and module functions
CLOCKED_WORKER = ("submit_store", "submit_load", "get_finished", "_issue_submitted",
                  "_issue_store", "_pump", "_issue_ring_piece", "_issue_spill",
                  "_issue_direct", "_issue_load", "_after_compute", "_after_pending_writes",
                  "_host_written", "_nbytes", "ring_gather", "load_to_gpu")
CLOCKED_RUNTIME = ("launch", "launch_on", "record", "wait_event", "wait_current",
                   "mark_current", "wait_mark", "query", "elapsed")
CLOCKED_COPIER = ("drain", "to_host")
#: issue_api="raw": the worker's lean-path objects and their methods
CLOCKED_RAW = (("_raw_gather", "launch_on"), ("_raw_load", "launch_on"),
               ("_raw_ids", "put"), ("_ptr_copy", "copy"))
CLOCKED_MODULES = (("ion_vllm.kv_tier.worker", "_flatten"),
                   ("ion_vllm.kv_tier.page_gather", "_device_ids"))


def clock_worker(w, clock: HostClock, restore: list) -> None:
    """Wrap the worker's parts in ``clock`` (instance attributes shadow the methods, so
    the worker's own calls go through the wrappers); ``restore`` gets (owner, name, old)
    for the module functions, which outlive the worker."""
    import importlib

    for name in CLOCKED_WORKER:
        setattr(w, name, clock.wrap(name, getattr(w, name)))
    for name in CLOCKED_RUNTIME:
        setattr(w.rt, name, clock.wrap(f"rt.{name}", getattr(w.rt, name)))
    for name in CLOCKED_COPIER:
        setattr(w.copier, name, clock.wrap(f"copier.{name}", getattr(w.copier, name)))
    for attr, name in CLOCKED_RAW:
        obj = getattr(w, attr, None)
        if obj is not None:
            setattr(obj, name, clock.wrap(f"{attr.lstrip('_')}.{name}", getattr(obj, name)))
    if getattr(w, "_ptr_drain", None) is not None:
        w._ptr_drain = clock.wrap("ptr_drain", w._ptr_drain)
    for mod_name, name in CLOCKED_MODULES:
        mod = importlib.import_module(mod_name)
        old = getattr(mod, name)
        restore.append((mod, name, old))
        setattr(mod, name, clock.wrap(name, old))


def _wait_reported(worker, job_id: int, first: list) -> None:
    """Poll until ``job_id`` is reported; ``first``: what the timed call returned."""
    results = list(first)
    while True:
        for r in results:
            assert r.success, f"job {r.job_id} failed"
            if r.job_id == job_id:
                return
        results = worker.get_finished()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_worker(canonical, device: str, issue_at: str, sizes: list[int], reps: int,
                   ring_mib: float, busy_ms: float, seed: int,
                   id_upload: str = "pin_memory", clock: HostClock | None = None,
                   issue_api: str = "torch") -> dict:
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    nblocks = canonical.tensors[0].tensor.shape[0]
    need = 2 * max(sizes)
    if need > nblocks:
        raise ValueError(f"{nblocks} GPU blocks are too few for jobs of {max(sizes)}")
    n_host = max(sizes) * 4
    w = IonKVTierWorker(canonical, num_host_blocks=n_host, ring_bytes=int(ring_mib * (1 << 20)),
                        log_interval_s=0, issue_at=issue_at, id_upload=id_upload,
                        issue_api=issue_api)
    restore: list = []
    if clock is not None:
        clock_worker(w, clock, restore)
    try:
        res = _rounds(w, canonical, device, issue_at, id_upload, sizes, reps, busy_ms, seed,
                      n_host, clock)
        res["issue_api"] = issue_api
        return res
    finally:
        for mod, name, old in restore:
            setattr(mod, name, old)


def _clock_on(clock: HostClock | None, on: bool, tag: str | None = None) -> None:
    """Keep (``on``) the next entry-point records of ``clock`` under ``tag``, or none."""
    if clock is not None:
        clock.recording, clock.tag = on, tag


def _rounds(w, canonical, device, issue_at, id_upload, sizes, reps, busy_ms, seed, n_host,
            clock):
    """The timed store/load rounds of ``measure_worker`` (every block checked)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.manager import IonHostSpec

    nblocks = canonical.tensors[0].tensor.shape[0]
    rows = [c.tensor for c in canonical.tensors]
    rng = np.random.default_rng(seed)
    spec = lambda ids: GPULoadStoreSpec(ids, [len(ids)], [0])  # noqa: E731
    out: dict = {}
    bad = 0
    job = 0
    for b in sizes:
        t_sub, t_fin, t_lsub, t_lfin = [], [], [], []
        for r in range(reps + 1):  # round 0 warms up (not counted)
            perm = rng.permutation(nblocks)
            src, dst = perm[:b].tolist(), perm[b:2 * b].tolist()
            host = rng.choice(n_host, size=b, replace=False).tolist()
            for t in rows:  # fresh bytes in the source blocks every round
                t[src] = torch.randint(-128, 128, (b, t.shape[1]), dtype=torch.int8,
                                       device=t.device)
            _sync(device)
            job += 1
            _busy(device, busy_ms)
            _clock_on(clock, bool(r), "submit_store")
            t0 = time.perf_counter()
            w.submit_store(job, spec(src), IonHostSpec(host))
            t1 = time.perf_counter()
            _clock_on(clock, bool(r), "get_finished after store")
            got = w.get_finished()
            t2 = time.perf_counter()
            _clock_on(clock, False)
            _sync(device)
            _wait_reported(w, job, got)
            _sync(device)
            for g, h in zip(src, host):
                hb = host_block(w, canonical, h)
                bad += any(not torch.equal(t[g, :c.page_size_bytes].cpu(), x)
                           for t, c, x in zip(rows, canonical.tensors, hb))
            job += 1
            _busy(device, busy_ms)
            _clock_on(clock, bool(r), "submit_load")
            t3 = time.perf_counter()
            w.submit_load(job, IonHostSpec(host), spec(dst))
            t4 = time.perf_counter()
            _clock_on(clock, bool(r), "get_finished after load")
            got = w.get_finished()
            t5 = time.perf_counter()
            _clock_on(clock, False)
            _sync(device)
            _wait_reported(w, job, got)
            _sync(device)
            bad += sum(any(not torch.equal(t[g], t[d]) for t in rows)
                       for g, d in zip(src, dst))
            if r:
                t_sub.append(t1 - t0)
                t_fin.append(t2 - t1)
                t_lsub.append(t4 - t3)
                t_lfin.append(t5 - t4)
        out[str(b)] = {"submit_store": _us(t_sub), "get_finished_after_store": _us(t_fin),
                       "submit_load": _us(t_lsub), "get_finished_after_load": _us(t_lfin)}
    w.shutdown()
    res = {"issue_at": issue_at, "id_upload": id_upload, "by_blocks": out, "bad_blocks": bad,
           "ring_slots": w.ring.num_slots}
    if clock is not None:
        res["breakdown"] = clock.summary()
    return res


def measure_parts(canonical, reps: int) -> tuple[dict, dict]:
    """CUDA only: host time of each operation a ring piece issues."""
    from ion_vllm.kv_tier import page_gather
    from ion_vllm.kv_tier.worker import IonKVTierWorker

    w = IonKVTierWorker(canonical, num_host_blocks=8, ring_bytes=64 << 20, log_interval_s=0,
                        issue_api="torch")
    dev = torch.device("cuda")
    cur = torch.cuda.current_stream()
    s = w._d2d
    ids4 = np.array([3, 1, 4, 1], dtype=np.int64)
    one = np.array([2], dtype=np.int64)
    host4, gpu4 = np.arange(4, dtype=np.int64), np.array([5, 6, 7, 9], dtype=np.int64)

    def timed(fn) -> dict:
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            xs.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return _us(xs)

    up = page_gather.IdUpload(dev)

    def staged_upload(ids):  # what the kernels' launches do (the event included)
        _, staged = up(ids)
        if staged:
            up.consumed()

    def stream_ctx():
        with torch.cuda.stream(s):
            pass

    ev = torch.cuda.Event()
    ev.record(cur)
    parts = {
        "event_record_timing": timed(lambda: torch.cuda.Event(enable_timing=True).record(s)),
        "event_record_plain": timed(lambda: torch.cuda.Event().record(cur)),
        "event_query": timed(ev.query),
        "stream_wait_stream": timed(lambda: s.wait_stream(cur)),
        "stream_wait_event": timed(lambda: s.wait_event(ev)),
        "stream_context": timed(stream_ctx),
        "id_upload_4_pin_memory": timed(lambda: page_gather._device_ids(ids4, dev)),
        "id_upload_4_staged": timed(lambda: staged_upload(ids4)),
        "gather_launch_4": timed(lambda: w.rt.launch(
            s, lambda: w.ring_gather(w.ring.buffer, 0, 0, ids4))),
        "drain_copy_1": timed(lambda: w.rt.launch(
            w._drain, lambda: w.copier.drain(w.ring.buffer, 0, w.host, one))),
        "load_launch_4": timed(lambda: w.rt.launch(
            w._load, lambda: w.load_to_gpu(w.host, 0, host4, gpu4))),
    }
    # the same operations on the raw issue path (issue_api="raw")
    wr = IonKVTierWorker(canonical, num_host_blocks=8, ring_bytes=64 << 20, log_interval_s=0,
                         issue_api="raw")
    sr = wr._d2d

    def stage_put(ids):
        wr._raw_ids.put(ids, sr)
        ev = torch.cuda.Event()
        ev.record(sr)
        wr._raw_ids.hold(ev)

    parts.update({
        "raw_stream_switch": timed(lambda: wr.rt.launch(sr, lambda: None)),
        "raw_id_stage_4": timed(lambda: stage_put(ids4)),
        "raw_gather_launch_4": timed(lambda: wr.rt.launch_on(
            sr, lambda st: wr._raw_gather.launch_on(st, 0, 0, ids4))),
        "raw_drain_copy_1": timed(lambda: wr.rt.launch_on(
            wr._drain, lambda st: wr._ptr_drain(0, [2], st))),
        "raw_load_launch_4": timed(lambda: wr.rt.launch_on(
            wr._load, lambda st: wr._raw_load.launch_on(st, 0, host4, gpu4))),
    })
    # a drain of a run of ring rows: one copy, or cut into 128 KiB copies issued in one
    # batched call (drain_chunk_kib, twenty-sixth session)
    wc = IonKVTierWorker(canonical, num_host_blocks=8, ring_bytes=64 << 20, log_interval_s=0,
                         issue_api="raw", drain_chunk_bytes=128 << 10)
    run = list(range(min(8, wr.ring.num_slots)))
    parts.update({
        f"raw_drain_run_{len(run)}": timed(lambda: wr.rt.launch_on(
            wr._drain, lambda st: wr._ptr_drain(0, run, st))),
        f"raw_drain_run_{len(run)}_chunked_128k": timed(lambda: wc.rt.launch_on(
            wc._drain, lambda st: wc._ptr_drain(0, run, st))),
    })
    wc.shutdown()
    wr.shutdown()
    w.shutdown()
    return parts, {"staged": up.staged, "fallbacks": up.fallbacks}


def run(args) -> dict:
    from ion_vllm.kv_tier.worker import canonicalize_layer_caches

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # calibrate the busy kernel: cycles per second
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(10**6)
        a.record()
        torch.cuda._sleep(10**7)
        b.record()
        b.synchronize()
        _busy.hz = 1e7 / (a.elapsed_time(b) * 1e-3)
        res_hz = _busy.hz
    else:
        res_hz = None
    caches = make_caches(args.layers, args.num_gpu_blocks, args.kv_heads, args.page,
                         args.head_dim, device, args.seed)
    canonical = canonicalize_layer_caches(caches, args.num_gpu_blocks)
    sizes = [int(x) for x in args.blocks.split(",") if x]
    compute = torch.cuda.Stream() if device == "cuda" else None
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "block_bytes": sum(c.page_size_bytes for c in canonical.tensors),
                 "args": vars(args), "busy_cycles_per_s": res_hz, "workers": []}
    ctx = torch.cuda.stream(compute) if compute is not None else _nullctx()
    with ctx:  # the "forward pass" runs on a non-default stream, as vLLM's may
        for api, id_upload, issue_at in worker_configs(args):
            res["workers"].append(measure_worker(canonical, device, issue_at, sizes,
                                                 args.reps, args.ring_mib, args.busy_ms,
                                                 args.seed + 1, id_upload,
                                                 issue_api=api))
        if device == "cuda":
            res["parts"], res["staged_uploads"] = measure_parts(canonical, args.reps * 5)
        if args.breakdown:
            res["breakdowns"] = []
            for api, id_upload, issue_at in worker_configs(args):
                res["breakdowns"].append(measure_worker(
                    canonical, device, issue_at, [args.breakdown], args.reps,
                    args.ring_mib, args.busy_ms, args.seed + 2, id_upload, HostClock(),
                    issue_api=api))
    return res


def worker_configs(args) -> list[tuple[str, str, str]]:
    """(issue_api, id_upload, issue_at) of every worker measured; under "raw" the id
    upload is the path's own (one staging buffer), so it is measured once."""
    out = []
    for api in args.issue_api.split(","):
        if api not in ISSUE_APIS:
            raise SystemExit(f"unknown issue api {api!r}")
        for id_upload in (args.id_upload.split(",") if api == "torch" else ["-"]):
            if id_upload != "-" and id_upload not in ID_UPLOADS:
                raise SystemExit(f"unknown id upload {id_upload!r}")
            for issue_at in args.issue_at.split(","):
                if issue_at not in ISSUE_POINTS:
                    raise SystemExit(f"unknown issue point {issue_at!r}")
                out.append((api, id_upload if id_upload != "-" else "pin_memory", issue_at))
    return out


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def table(res: dict) -> list[str]:
    lines = [f"# KV tier worker host time ({res['device']})", "",
             f"blocks of {res['block_bytes'] / 2**20:.2f} MiB, {res['args']['reps']} rounds "
             f"each, compute stream kept busy ({res['args']['busy_ms']} ms kernel); "
             "median / p90 us of host time", "",
             "| issue api | issue_at | id upload | blocks | submit_store | "
             "get_finished after | submit_load | get_finished after | bad blocks |",
             "|---|---|---|---|---|---|---|---|---|"]
    f = lambda d: f"{d['median_us']:.0f} / {d['p90_us']:.0f}"  # noqa: E731
    for wr in res["workers"]:
        for b, d in wr["by_blocks"].items():
            up = wr["id_upload"] if wr.get("issue_api", "torch") == "torch" else "stage"
            lines.append(f"| {wr.get('issue_api', 'torch')} | {wr['issue_at']} | {up} | {b} | "
                         f"{f(d['submit_store'])} | "
                         f"{f(d['get_finished_after_store'])} | {f(d['submit_load'])} | "
                         f"{f(d['get_finished_after_load'])} | {wr['bad_blocks']} |")
    if "parts" in res:
        lines += ["", "| operation | median us | p90 us |", "|---|---|---|"]
        for k, d in res["parts"].items():
            lines.append(f"| {k} | {d['median_us']:.1f} | {d['p90_us']:.1f} |")
        su = res["staged_uploads"]
        lines.append(f"\nstaged id uploads: {su['staged']}, fell back to pin_memory: "
                     f"{su['fallbacks']}")
    for wr in res.get("breakdowns", []):
        b = next(iter(wr["by_blocks"]))
        lines += ["", f"In-flow breakdown, issue api {wr.get('issue_api', 'torch')}, "
                  f"issue_at={wr['issue_at']}, id upload "
                  f"{wr['id_upload']}, jobs of {b} blocks: median exclusive host us per call "
                  "of each wrapped part (the entry point's own name: its own code)", "",
                  "| entry point | calls | total | parts |", "|---|---|---|---|"]
        for entry, d in wr["breakdown"].items():
            parts = ", ".join(f"{k} {v:.0f}" for k, v in d["parts"].items() if v >= 0.5)
            lines.append(f"| {entry} | {d['calls']} | {d['total_us']:.0f} | {parts} |")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--issue-at", default="submit,finish")
    p.add_argument("--id-upload", default="pin_memory,staged",
                   help="the copy kernels' id uploads to measure (CUDA; on a CPU both "
                        "take the same path)")
    p.add_argument("--issue-api", default="torch,raw",  # both, the older path first
                   help="the worker's issue paths to measure (raw: CUDA's lean path; on a "
                        "CPU its drains are memmoves)")
    p.add_argument("--blocks", default="1,4,16", help="store job sizes, in blocks")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--breakdown", type=int, default=4,
                   help="job size (blocks) of the in-flow breakdown pass; 0: no such pass")
    p.add_argument("--busy-ms", type=float, default=3.0)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--num-gpu-blocks", type=int, default=64)
    p.add_argument("--ring-mib", type=float, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    lines = table(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_cost.json"), "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.join(args.out, "host_cost.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if any(w["bad_blocks"] for w in res["workers"] + res.get("breakdowns", [])) else 0


if __name__ == "__main__":
    raise SystemExit(main())
