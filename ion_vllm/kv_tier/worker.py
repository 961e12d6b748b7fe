"""Worker side of the Ion KV tier: GPU -> HBM ring -> pinned host, host -> GPU
(docs/kv_tier.md, "The data path"; layouts and copies: copies.py; verify mode: verify.py).

Store (one job = the new full blocks of one request in one step), issued inside vLLM's
``submit_store``, before the step's forward pass is enqueued: (1) gather the GPU blocks
into a contiguous run of ring slots on vLLM's compute stream, in line with the forward
pass that wrote them (``page_gather.py``); (2) drain the run to the host rows on the drain
stream, after (1); (3) once the drain has completed, give the slots back (``_reclaim``).
What the ring has no room for is copied GPU -> host at once on the drain stream, after the
compute stream (a spill): the forward pass never waits for it.  The tier runs no kernel on
a stream of its own: on the H100 a kernel on a second stream cost every later CUDA-graph
kernel boundary ~0.4 us for the rest of the run.

A store job is reported finished once its GPU source blocks have been read (after the
gather of a ring piece, after the PCIe copy of a spill), so vLLM's flushes, HIT_PENDING
deferrals and preemption delays wait for an HBM copy, not for PCIe.  vLLM then marks the
host blocks loadable while a drain may still run.  That is safe because this worker owns
every reader and writer of the host pool: a load, and any later write into a host block
that was evicted and handed out again, waits on the device for the block's last pending
write (``_host_pending``).  The store's ``transfer_time`` is therefore the gather's; the
D2H rate is exported apart (stats.py).

Load: host -> GPU on the load stream through the copier (the copy engines), after any
pending write of its host blocks and NOT after the compute stream: the destination blocks
belong to a request that computes nothing until the load is reported, and vLLM 0.26 defers
freeing a block while an in-flight step may still write it (``defer_block_free``, checked
by tests/test_kv_tier_scheduler.py).  Waiting for the compute stream as well delayed every
restore by up to one forward step on the H200.

Failures: a copy that cannot be issued (its launch raises) fails its blocks, not the
engine.  A store's failed host blocks are marked bad until stored again; a load of a bad
host block, a load copy that failed, or (verify mode) a restored block whose fingerprint
differs, is reported to vLLM as an invalid GPU block (``take_invalid_block_ids``, wired
to the connector's ``get_block_ids_with_load_errors`` by vllm_guards), so vLLM recomputes
it under ``kv_load_failure_policy: recompute`` and fails the request under ``fail``.
vLLM 0.26's connector asserts that every job succeeded, so the job itself is reported
finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ion_vllm.kv_tier import page_gather
from ion_vllm.kv_tier.config import KVTierConfig
from ion_vllm.kv_tier.copies import (
    BatchCopier,
    TorchCopier,
    batch_copier_available,
    group_runs,
)
from ion_vllm.kv_tier.host_pool import HostPool
from ion_vllm.kv_tier.runtime import CudaRuntime, SimRuntime
from ion_vllm.kv_tier.staging_ring import StagingRing
from ion_vllm.kv_tier.stats import PROCESS_COUNTERS, WorkerStats
from ion_vllm.kv_tier.trace_ranges import traced
from ion_vllm.kv_tier.verify import BlockVerifier, FpBatch

logger = logging.getLogger(__name__)


@dataclass
class _Piece:
    job: "_StoreJob"
    first: int
    count: int
    ring_run: tuple[int, int] | None  # None: a spill (GPU -> host directly)
    read_done: Any  # event: the GPU source blocks have been read
    start: Any  # event: the host copy starts (the drain, for a ring piece)
    end: Any  # event: the bytes are on the host
    fp: FpBatch | None = None  # verify mode: fingerprints of the source blocks
    src_start: Any = None  # ring piece: event before its gather


@dataclass
class _StoreJob:
    job_id: int
    groups: np.ndarray
    gpu: np.ndarray
    host: np.ndarray
    nbytes: int
    next_item: int = 0
    pieces: list[_Piece] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.gpu)


@dataclass
class _LoadJob:
    job_id: int
    nbytes: int
    groups: np.ndarray
    gpu: np.ndarray
    host: np.ndarray
    start: Any
    end: Any
    expected: list | None = None  # verify mode: the host blocks' fingerprints at submit
    bad: set[int] = field(default_factory=set)  # positions whose restore is invalid


def _flatten(gpu_spec: GPULoadStoreSpec, other: BlockIDsLoadStoreSpec):
    gpu = np.asarray(gpu_spec.block_ids, dtype=np.int64)
    oth = np.asarray(other.block_ids, dtype=np.int64)
    if len(gpu) != len(oth):
        raise ValueError(
            f"Ion KV tier needs one host block per GPU block (blocks_per_chunk=1); "
            f"got {len(gpu)} GPU and {len(oth)} host blocks")
    sizes = list(gpu_spec.group_sizes)
    groups = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    assert len(groups) == len(gpu)
    return groups, gpu, oth


class IonKVTierWorker(OffloadingWorker):
    """``IonKVTierWorker(kv_caches, config, num_host_blocks)``: what vLLM hands the spec,
    the tier's config and the host pool's size in blocks.  ``runtime``: the streams and
    events (default: CUDA on a CUDA KV cache, else synchronous ``SimRuntime``; tests pass
    their own)."""

    LOG_INTERVAL_S = 30.0  # the stats line; 0: never

    def __init__(self, kv_caches: CanonicalKVCaches, config: KVTierConfig,
                 num_host_blocks: int, runtime: Any | None = None):
        if not kv_caches.tensors:
            raise ValueError("no KV cache tensors")
        self.config = config
        self.tensors = [c.tensor for c in kv_caches.tensors]
        num_blocks = self.tensors[0].shape[0]
        for c in kv_caches.tensors:
            t = c.tensor
            assert t.dtype == torch.int8 and t.ndim == 2 and t.shape[0] == num_blocks
            assert t.stride(1) == 1 and t.shape[1] >= c.page_size_bytes
        self.page_bytes = [c.page_size_bytes for c in kv_caches.tensors]
        self.offsets = [int(x) for x in np.cumsum([0] + self.page_bytes[:-1])]
        self.slot_bytes = int(sum(self.page_bytes))
        group_refs = [[(r.tensor_idx, r.page_size_bytes) for r in g]
                      for g in kv_caches.group_data_refs]
        self.group_bytes = [sum(nb for _, nb in g) for g in group_refs]
        self.device = self.tensors[0].device
        is_cuda = self.device.type == "cuda"
        self.rt = runtime if runtime is not None else (
            CudaRuntime(self.device) if is_cuda else SimRuntime(eager=True))
        self.num_host_blocks = num_host_blocks
        t0 = time.monotonic()
        self.host_pool = HostPool(num_host_blocks, self.slot_bytes, pin=is_cuda)
        self.host = self.host_pool.tensor
        logger.info("Ion KV tier: %d host blocks x %d B = %.2f GiB pinned=%s (%.1fs)",
                    num_host_blocks, self.slot_bytes,
                    num_host_blocks * self.slot_bytes / 2**30, self.host_pool.pinned,
                    time.monotonic() - t0)
        # pageable host memory: plain torch copies (staged by the driver)
        self.copier = self._copier_cls(is_cuda and self.host_pool.pinned)(
            self.tensors, self.offsets, group_refs)
        self.ring = StagingRing(config.ring_bytes, self.slot_bytes, self.device)
        self.ring_gather, self.ring_gather_impl = self._make_ring_gather(is_cuda)
        logger.info("Ion KV tier: ring of %d slots (%d MiB), GPU -> ring by %s, copies by "
                    "%s", self.ring.num_slots, self.ring.nbytes >> 20, self.ring_gather_impl,
                    self.copier.name)
        self._drain = self.rt.new_stream()  # ring drains and spills
        self._load = self.rt.new_stream()
        self._stores: dict[int, _StoreJob] = {}
        self._ring_pieces: list[_Piece] = []  # holding ring slots, oldest first
        self._loads: dict[int, _LoadJob] = {}
        self._host_pending: dict[int, Any] = {}  # host id -> end event of its last write
        self._bad_host: set[int] = set()  # host blocks whose last store failed
        self._invalid_gpu: set[int] = set()  # GPU blocks of failed loads, not yet reported
        self.stats = WorkerStats(ring_slots=self.ring.num_slots)
        self._last_log = time.monotonic()
        self.verifier = (BlockVerifier(self.rt, self.tensors, self.page_bytes, self.offsets,
                                       group_refs, self.stats) if config.verify else None)

    @staticmethod
    def _copier_cls(is_cuda: bool) -> type[TorchCopier]:
        """vLLM's batched copy on CUDA where its ops carry it, else plain torch copies."""
        return BatchCopier if is_cuda and batch_copier_available() else TorchCopier

    def _make_ring_gather(self, is_cuda: bool):
        """(the GPU -> ring gather, its name): the Triton kernel on CUDA, compiled now (not
        inside the first forward step that stores); the copier's gather on a CPU, without
        Triton, for a ring of no slots, or for a KV layout the kernel cannot address."""
        if self.ring.num_slots and is_cuda and page_gather.available():
            try:
                gather = page_gather.PageGather(self.tensors, self.copier.group_refs,
                                                self.copier.placement, self.ring.buffer)
            except ValueError as e:  # alignment
                logger.warning("Ion KV tier: GPU -> ring gather on the copy engines (%s)", e)
            else:
                gather.warm_up()
                torch.cuda.synchronize(self.device)
                return gather, "kernel"
        return self.copier.gather, "copier"

    def _nbytes(self, groups: np.ndarray) -> int:
        """Bytes of the blocks whose KV groups are ``groups`` (one entry per block)."""
        return int(sum(self.group_bytes[g] for g in groups))

    # ------------------------------------------------------------ stores
    @traced("ion_kv:submit_store")
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        groups, gpu, host = _flatten(src_spec, dst_spec)
        job = _StoreJob(job_id, groups, gpu, host, self._nbytes(groups))
        self._stores[job_id] = job
        self.stats.store_jobs += 1
        if self._bad_host:  # rewritten now
            self._bad_host.difference_update(host.tolist())
        self._reclaim()
        while job.next_item < job.n:
            run = self.ring.alloc.alloc(job.n - job.next_item)
            if run is None:
                break
            self._issue_ring_piece(job, *run)
        if job.next_item < job.n:
            self._issue_spill(job)
        self.stats.ring_used_slots = self.ring.alloc.used
        return True

    def _issue_ring_piece(self, job: _StoreJob, start: int, count: int) -> None:
        rt, ring = self.rt, self.ring.buffer
        a, b = job.next_item, job.next_item + count
        compute = rt.current_stream()  # in line with the work that wrote the blocks
        src_start = rt.record(compute)
        ok = True
        for g, i0, i1 in group_runs(job.groups, a, b):
            ids, s = job.gpu[i0:i1], start + (i0 - a)
            ok &= self._copy(compute, lambda g=g, ids=ids, s=s:
                             self.ring_gather(ring, s, g, ids))
        fp = self._fingerprint_store(compute, job, a, b)
        read_done = rt.record(compute)
        if fp is not None:
            fp.event = read_done
        rt.wait_event(self._drain, read_done)
        hids = job.host[a:b]
        self._after_pending_writes(self._drain, hids)
        ev0 = rt.record(self._drain)
        ok &= self._copy(self._drain,
                         lambda: self.copier.drain(ring, start, self.host, hids))
        ev1 = rt.record(self._drain)
        p = _Piece(job, a, count, (start, count), read_done, ev0, ev1, fp, src_start)
        if not ok:
            self._store_failed(hids)
        job.pieces.append(p)
        job.next_item = b
        self._ring_pieces.append(p)
        for h in hids.tolist():
            self._host_pending[h] = ev1
        self.stats.d2d_blocks += count
        self.stats.d2d_bytes += count * self.slot_bytes
        PROCESS_COUNTERS.ring_blocks += count
        self.stats.ring_peak_slots = max(self.stats.ring_peak_slots, self.ring.alloc.used)

    def _issue_spill(self, job: _StoreJob) -> None:
        """The job's blocks not yet issued, GPU -> host now on the drain stream, after the
        compute stream that produced them, as one piece."""
        rt, stream = self.rt, self._drain
        a, b = job.next_item, job.n
        rt.wait_current(stream)
        self._after_pending_writes(stream, job.host[a:b])
        ev0 = rt.record(stream)
        ok = True
        for g, i0, i1 in group_runs(job.groups, a, b):
            gids, hids = job.gpu[i0:i1], job.host[i0:i1]
            ok &= self._copy(stream, lambda g=g, gids=gids, hids=hids:
                             self.copier.to_host(self.host, g, gids, hids))
        fp = self._fingerprint_store(stream, job, a, b)
        ev1 = rt.record(stream)
        if fp is not None:
            fp.event = ev1
        if not ok:
            self._store_failed(job.host[a:b])
        job.pieces.append(_Piece(job, a, b - a, None, ev1, ev0, ev1, fp))
        for h in job.host[a:b].tolist():
            self._host_pending[h] = ev1
        job.next_item = b
        self.stats.spill_blocks += b - a
        self.stats.spill_bytes += self._nbytes(job.groups[a:b])
        PROCESS_COUNTERS.spill_blocks += b - a

    def _copy(self, stream: Any, fn) -> bool:
        """Issue one copy on ``stream``; False (logged) when it cannot be issued: its
        blocks are then invalid, and the engine goes on."""
        try:
            self.rt.launch(stream, fn)
        except Exception:  # noqa: BLE001 - any issue failure fails the blocks, not vLLM
            logger.exception("Ion KV tier: a copy could not be issued; its blocks are "
                             "reported invalid")
            self.stats.failed_copies += 1
            return False
        return True

    def _store_failed(self, host_ids: np.ndarray) -> None:
        """A store piece whose copy failed leaves its host blocks bad until rewritten: a
        load of them is reported invalid."""
        self._bad_host.update(host_ids.tolist())
        self.stats.failed_store_blocks += len(host_ids)

    def _fingerprint_store(self, stream: Any, job: _StoreJob, a: int,
                           b: int) -> FpBatch | None:
        if self.verifier is None:
            return None
        return self.verifier.store(stream, job.groups[a:b], job.gpu[a:b], job.host[a:b])

    def _after_pending_writes(self, stream: Any, host_ids: np.ndarray) -> bool:
        """Order work queued next on ``stream`` after every still-pending write into these
        host blocks (loads read them; a host block can also be evicted and handed to a new
        store while its old drain still runs).  Returns whether there was any."""
        waits = {id(ev): ev for h in host_ids.tolist()
                 if (ev := self._host_pending.get(h)) is not None}
        for ev in waits.values():
            self.rt.wait_event(stream, ev)
        return bool(waits)

    def _host_written(self, p: _Piece) -> None:
        """``p``'s bytes are in host memory: account its D2H copy and forget the pending
        writes it was the last of."""
        job = p.job
        dt = self.rt.elapsed(p.start, p.end)
        nbytes = self._nbytes(job.groups[p.first:p.first + p.count])
        if p.ring_run is None:
            self.stats.spill_seconds += dt
        else:
            self.stats.drained_blocks += p.count
            self.stats.drained_bytes += nbytes
            self.stats.drain_seconds += dt
        PROCESS_COUNTERS.d2h_bytes += nbytes
        PROCESS_COUNTERS.d2h_seconds += dt
        for h in job.host[p.first:p.first + p.count].tolist():
            if self._host_pending.get(h) is p.end:
                del self._host_pending[h]

    def _reclaim(self) -> None:
        """Give the slots of completed drains back to the ring (they complete in order)."""
        done = 0
        for p in self._ring_pieces:
            if not self.rt.query(p.end):
                break
            self.ring.alloc.release_oldest(*p.ring_run)
            self._host_written(p)
            done += 1
        if done:
            del self._ring_pieces[:done]
        self.stats.ring_used_slots = self.ring.alloc.used

    # ------------------------------------------------------------ loads
    @traced("ion_kv:submit_load")
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        self.stats.load_jobs += 1
        groups, gpu, host = _flatten(dst_spec, src_spec)
        rt, stream = self.rt, self._load
        # no rt.wait_current(stream): see "Load" in the module docstring
        self.stats.loads_ordered_after_drain += self._after_pending_writes(stream, host)
        ev0 = rt.record(stream)
        bad = ({k for k, h in enumerate(host.tolist()) if h in self._bad_host}
               if self._bad_host else set())
        for g, i0, i1 in group_runs(groups, 0, len(gpu)):
            hids, gids = host[i0:i1], gpu[i0:i1]
            if not self._copy(stream, lambda g=g, hids=hids, gids=gids:
                              self.copier.to_gpu(self.host, g, hids, gids)):
                bad.update(range(i0, i1))
        ev1 = rt.record(stream)
        ld = _LoadJob(job_id, self._nbytes(groups), groups, gpu, host, ev0, ev1, bad=bad)
        if self.verifier is not None:
            ld.expected = self.verifier.expect(host)
        self._loads[job_id] = ld
        return True

    # ------------------------------------------------------------ completion
    @traced("ion_kv:get_finished")
    def get_finished(self) -> list[TransferResult]:
        rt = self.rt
        self._reclaim()
        out: list[TransferResult] = []
        for jid, job in list(self._stores.items()):
            if not all(rt.query(p.read_done) for p in job.pieces):
                continue
            secs = 0.0  # a spill's read_done is its end; a ring piece is its gather's
            for p in job.pieces:
                if p.fp is not None:
                    self.verifier.resolve(p.fp)  # done before read_done; frees it
                if p.ring_run is None:
                    self._host_written(p)
                    secs += rt.elapsed(p.start, p.end)
                else:
                    secs += rt.elapsed(p.src_start, p.read_done)
            del self._stores[jid]
            out.append(TransferResult(job_id=jid, success=True, transfer_size=job.nbytes,
                                      transfer_time=secs))
        for jid, ld in list(self._loads.items()):
            if not rt.query(ld.end):
                continue
            if self.verifier is not None:
                ld.bad.update(self.verifier.check_load(jid, ld.groups, ld.gpu, ld.host,
                                                       ld.expected, ld.end))
            if ld.bad:
                self._load_failed(jid, ld)
            dt = rt.elapsed(ld.start, ld.end)
            self.stats.loaded_blocks += len(ld.gpu)
            self.stats.loaded_bytes += ld.nbytes
            self.stats.load_seconds += dt
            del self._loads[jid]
            out.append(TransferResult(job_id=jid, success=True, transfer_size=ld.nbytes,
                                      transfer_time=dt))
        self._reclaim()
        if self.LOG_INTERVAL_S and time.monotonic() - self._last_log > self.LOG_INTERVAL_S:
            self._last_log = time.monotonic()
            logger.info("Ion KV tier worker: %s", self.stats.as_dict())
        return out

    def _load_failed(self, jid: int, ld: _LoadJob) -> None:
        ids = [int(ld.gpu[k]) for k in sorted(ld.bad)]
        self._invalid_gpu.update(ids)
        self.stats.failed_load_blocks += len(ids)
        PROCESS_COUNTERS.failed_load_blocks += len(ids)
        logger.error("Ion KV tier: load job %d restored %d of %d blocks wrongly or not at "
                     "all (GPU blocks %s); reported to vLLM as invalid, to be recomputed",
                     jid, len(ids), len(ld.gpu), ids[:16])

    def take_invalid_block_ids(self) -> set[int]:
        """GPU block ids of loads that failed since the last call (vLLM's
        ``get_block_ids_with_load_errors`` contract: reported once, in the step whose
        ``get_finished`` reported their job)."""
        out, self._invalid_gpu = self._invalid_gpu, set()
        return out

    @traced("ion_kv:wait")
    def wait(self, job_ids: set[int]) -> None:
        """Return once the GPU source blocks of these jobs may be reused (stores) or the
        loaded blocks are in place (loads)."""
        for jid in job_ids:
            ld = self._loads.get(jid)
            if ld is not None:
                self.rt.sync(ld.end)
                continue
            job = self._stores.get(jid)
            for p in job.pieces if job is not None else ():
                self.rt.sync(p.read_done)
        self._reclaim()

    def shutdown(self) -> None:
        for job in list(self._stores.values()):
            for p in job.pieces:
                self.rt.sync(p.end)
        for p in self._ring_pieces:  # reported finished, still draining
            self.rt.sync(p.end)
        for ld in self._loads.values():
            self.rt.sync(ld.end)
        self._ring_pieces.clear()
        if self.verifier is not None:
            self.verifier.summary()
        self.host_pool.close()

    # ------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        a = self.ring.alloc
        a.check()
        assert a.used * self.slot_bytes <= self.ring.nbytes, "staging ring overflow"
        assert sum(p.count for p in self._ring_pieces) == a.used, "ring slot leak"
