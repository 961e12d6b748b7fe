"""Worker side of the Ion KV tier: GPU -> HBM ring -> pinned host, host -> GPU.

Data layout
-----------
vLLM's OffloadingConnector hands the spec ``CanonicalKVCaches``: a list of
tensors whose first dimension is ``num_blocks`` (one per layer, or one for a
cross-layer KV cache), viewed as int8 rows of ``page_size_bytes``.  This holds
for the ION layout ``[num_blocks, 2, Hkv, P, D]`` and for FLASH_ATTN in vLLM
0.26 (``[num_blocks, Hkv, P, 2*D]``, K and V packed into the last dim).  For a
layout whose outer dim is K/V (``[2, num_blocks, P, Hkv, D]``), use
``canonicalize_layer_caches`` which splits it into a K and a V tensor, each
blocks-first; the worker itself only ever sees blocks-first rows.

A host block (and a ring slot) holds the block's bytes in every canonical tensor:
``slot_bytes = sum(page_size_bytes)`` (= vLLM's ``worker_kv_bytes_per_block``).
``host_layout`` says how: ``"slot"`` (default) concatenates them in one row per
block; ``"tensor"`` keeps one region per canonical tensor in the same buffers, so
that a run of consecutive blocks of one tensor is contiguous on the host as it is
on the GPU, and a direct copy of such a run is one descriptor (see
``TorchCopier``).

Store (one job = the new full blocks of one request in one step)
------------------------------------------------------------------
1. D2D on a high-priority stream, after the compute stream: gather the GPU
   blocks into a contiguous run of ring slots (one Triton launch on the SMs,
   ``page_gather.py``; the copy engines gathered pages at ~7 GB/s on the H200).
2. Drain on a low-priority stream, after (1): copy the ring run to the host
   blocks (one memcpy per run of consecutive host ids; per run and tensor in the
   ``tensor`` host layout; with ``drain_chunk_bytes``, those copies cut into pieces
   of at most that size, issued in one batched call: ``raw_issue.PointerDrain``).
3. When the drain completes the slots go back to the ring.
``gather_priority`` "normal" puts (1) at the compute stream's priority instead of
above it.  ``ring_max_job_blocks`` > 0 keeps jobs of more blocks than that off the
ring: they are copied GPU -> host directly, as a spill (below), and only smaller jobs
(a decode step's new block, a returning turn's few new blocks) use the ring.
``gather_stream`` "drain" queues (1) on the drain stream instead of a stream of its own,
and "compute" on the compute stream itself (see "One compute stream" below);
``gather_ids`` "host" lets the gather kernel read its block ids from pinned host memory,
so that (1) is one kernel launch with no host -> device copy in front of it.  The
twenty-sixth and twenty-seventh sessions measured the ring path costing ~0.5 s of a
36 s turn of cold prompts against the same blocks copied directly (``bench/notes.md``),
and read it as ~1 ms per ring piece; these options were that reading's suspects.  The
twenty-eighth session measured them apart: none changed the cost, and neither did three
times fewer pieces (store batching, below), so it follows neither pieces nor bytes.
``wait(job)`` (vLLM calls it before it reuses the source GPU blocks: flush on
preemption or block reuse) waits only for step (1) of ring pieces.

Store batching (``store_batch_blocks`` K > 0; off by default): a store job of fewer than
K blocks (a decode step's new block) is held, not issued; the held jobs are issued
together as one job (one gather and one drain, or one direct copy) once they hold K
blocks, once the oldest has been held ``store_batch_steps`` engine steps (``get_finished``
calls), before any job of K blocks or more (submission order is kept), and at once when
vLLM flushes (``wait``) one of them.  Each is still reported finished under its own id.
Holding is safe because vLLM keeps a store's source blocks until the store is reported
finished; the issued copies wait for the compute stream as it is when they are issued
(or, under ``issue_at="finish"``, for the newest held job's mark), which is later than
the work that wrote the blocks.  It tests the per-piece reading above without naming the
mechanism: K held decode stores cost one ring piece instead of K.  Measured on the H100
(twenty-eighth session): about five decode stores a piece, a third of the pieces, and turn
1 as slow as without it; so the ring's cost is not per piece, and batching stays off.

When a store job is reported finished (``get_finished``; ``completion``):
* ``"read"`` (default): once every GPU source block has been read, i.e. after the
  D2D copy of a ring piece and after the PCIe copy of a direct piece.  vLLM 0.26
  then marks the host blocks loadable (``complete_store``) while a ring piece may
  still be draining.  That is safe because this worker owns every reader and writer
  of the host pool: a load waits on the device for the last pending write of each
  of its host blocks (``_host_pending``), and so does any later write to a host
  block that was evicted and handed out again.  What it buys: vLLM answers a
  lookup of an unfinished store with HIT_PENDING and defers the request, it
  delays a preempted request until its own store jobs are finished, and it
  flushes (``wait``) unfinished jobs whose source blocks it reallocates; for the
  blocks that went through the ring, none of the three waits for PCIe any more.
* ``"host"``: once all the job's bytes are in host memory (the tier's first form;
  kept for A/B runs).
vLLM's ``TransferResult.transfer_time`` of a store is the time to that point
(D2D time for a ring piece under "read"); the D2H drain rate is exported
separately (``vllm:ion_kv_tier_d2h_bytes`` / ``_d2h_seconds``).

When the ring has no room for the rest of a job (``overflow``):
* ``"direct"`` (default): the rest is copied GPU -> host at once, on the drain
  stream after the compute stream (a ``spill`` piece, counted).  The forward
  pass never waits for it; a flush of that job waits for its PCIe copy, exactly
  as vLLM's native connector's flush always does.
* ``"defer"``: the rest waits in a queue for ring slots, which are reclaimed
  when the worker is next called (``get_finished`` / ``submit_store``, i.e. once
  per engine step); a flush of a job with deferred blocks copies them GPU ->
  host directly (``bypass``) and waits for it.  Measured on the H200 (reuse
  benchmark, 8k contexts, 256 MiB ring = 70 blocks of 3.7 MB): a wave's stores
  are thousands of blocks, so the ring issued at most ~70 blocks a step and the
  PCIe link sat idle between steps; flushes then waited on long bypass copies.
  Ion lost to native (73.4k vs 79.3k tok/s, TTFT p50 604 vs 466 ms), which is
  why ``direct`` is the default.

Load: host -> GPU on its own stream, ordered after any still-running drain of
the same host blocks, and NOT after the compute stream.  By default (``load_copy``
"copier", since the thirty-first session; see "One compute stream") the copy engines
move the bytes.  With ``load_copy`` "auto" on CUDA they are moved by a few persistent
Triton programs that read the pinned host pool through its unified address
(``page_gather.HostPageCopy``), not by the copy engines: copies of one direction run in
issue order whatever their stream, so a load on the copy engines holds up the next
engine step's own host -> GPU input copies, and with them the step, until the whole
load has crossed PCIe (measured on the H200: 4.8 ms behind a 256 MiB load; 58 µs behind
the kernel's; end to end on the reuse benchmark the two paths tied).  The destination blocks
were just allocated to a request that computes nothing until the load is
reported finished; the only writer that could still touch them is an in-flight
step of the request that freed them (async scheduling: step N runs while step
N+1 is scheduled).  vLLM 0.26 fences exactly that: with more than one batch in
flight and a consumer connector (``kv_both``), ``Scheduler._free_request_blocks``
defers returning a finished or preempted request's blocks to the pool until its
last scheduled step has been processed (``defer_block_free``; checked by
``tests/test_kv_tier_scheduler.py``).  Ordering loads after the compute stream
as well delayed every restore by up to one whole forward step (measured on the
H200: TTFT p50 634 ms against native's 535 ms, whose loads do not wait either).

Issue (``issue_at``)
-------------------
vLLM calls ``submit_store`` / ``submit_load`` from ``start_load_kv``, before the step's
forward pass is enqueued, and ``get_finished`` after it.  Host time spent in the first
delays the launch of the forward pass, and the GPU sits idle for it; host time in the
second overlaps the forward pass running on the GPU.  With ``"finish"`` a submit only
records the job, in order, and for a store an event at the compute stream's present end
(``rt.mark_current``, one event record); the GPU work (ring gather, drain, spill, load)
is issued at the start of the next ``get_finished`` or ``wait``, in submission order.
A store's copies wait for that event, not for the compute stream as it is when issued,
so they start on the GPU when they did before, beside the next forward pass (the first
form waited for the current step's forward pass as well: a store's source blocks were
read one step later, and on the reuse benchmark it measured 12,580 tok/s against
12,719 for ``"submit"``, one run each).  A load is still ordered after any pending write
of its host blocks.  Measured on the H200 (profiled decode steps, reuse
benchmark): the compute stream's busy time was the same as under vLLM's native worker,
its idle time 76 ms longer over 300 steps, and ``submit_store`` took 684 us of host time
a call inside the windows where the GPU waited for the forward launch.  ``"submit"``
(the default) issues inside the submit calls.  The event-ordered ``"finish"`` did not
measure ahead on the H100 (twenty-fourth session: 0.994 / 0.991 of native against 0.993
for ``"submit"``, the same step time): it moves the host time into ``get_finished``,
where it costs the engine loop as much.

How the copies are issued (``issue_api``): ``"raw"`` (the default) issues the same GPU
work as ``"torch"`` with about a third of the host time: compiled Triton launchers on
explicit stream handles, ids through persistent staging buffers, drains as
``cudaMemcpyAsync`` per run of host rows (``raw_issue.py``); measured on the H100:
160 against 458 us for a 4-block ``submit_store``.  End to end that host time did not
show (a probe adding 2 ms a store job left the wall time unchanged; twenty-fifth
session).

Host-time probe (spec keys ``host_delay_us`` / ``host_delay_at``; test-only, off by
default): every store job spends that much extra host time (a busy wait, the GIL held),
inside ``submit_store`` ("submit") or in the next ``get_finished`` ("finish").  It
measures how much of the tier's host time reaches the engine's wall time, and whether it
matters where in the engine loop that time sits (bench configs ``ion-delay-submit`` /
``ion-delay-finish``).

Idle-ring probe (spec key ``ring_idle``; test-only, off by default): the ring is made as
configured (its HBM allocated, its gather compiled) but no store uses it; every block is
copied GPU -> host directly, as with ``ring_mib`` 0.  Every ring config measured through
the twenty-ninth session cost ~0.4-0.6 s of a 36 s cold turn against ``ring_mib`` 0, at
any ring size (one 3.5 MiB slot to 256 MiB) and any piece count; this separates the
ring's presence from its use (bench config ``ion-ringidle``).

One compute stream (``gather_stream="compute"``; with ``load_copy="copier"``, bench config
``ion-onestream``).  The thirtieth session's profiles (H100) found one signature behind
both of Ion's measured losses, the ring's cost in a cold turn and the returning turns'
cost: once the process has run a kernel on a stream other than vLLM's compute stream
(the ring gather on its own stream; the SM load kernel on the load stream), every kernel
boundary inside the decode steps' CUDA graphs idles ~0.4 us longer for the rest of the
run, far from any side work as much as near it. The early launch of the next kernel is
lost (11,004 of 11,004 boundaries of one pair show a gap, against ~2,000 of 11,144
without side kernels). That is ~1.8% of a decode step. Configs that put only copy-engine
copies on other streams (vLLM's native worker, ``ring_mib`` 0 before any load) keep the
overlap. With ``gather_stream="compute"``, the gather kernel runs on the compute stream
as it is at issue time (``submit_store`` / ``get_finished``, between the engine's
forward passes), in line with the work that wrote its blocks, so it needs no
cross-stream wait. With ``load_copy="copier"``, loads go to the copy engines. Together,
the tier then runs no kernel on a stream of its own. Measured in the thirty-first
session (H100, 3-turn reuse workload, 2 interleaved repeats): total tok/s 1.010 ± 0.004
of vLLM's native offloading (1.013, 1.007), where the side-stream defaults had measured
0.994 ± 0.002; both are now the defaults (bench config ``ion-sidestreams`` keeps the
earlier pair, ``gather_stream="own"`` with ``load_copy="auto"``). On the H200
(thirty-second session, 3 interleaved repeats) they measured 1.012 ± 0.001 of native,
and 1.181x recompute.

Verify mode (``ION_KV_TIER_VERIFY=1`` or the spec's ``verify`` key; a test mode,
off by default: it costs GPU time and a host sync per finished load)
----------------------------------------------------------------------------
* store: right after the D2D gather (ring path) or next to the direct copy
  (bypass), on the same stream and before the event that lets vLLM reuse the
  source blocks, the GPU SOURCE blocks are fingerprinted (``BlockFingerprinter``:
  the exact bytes the tier copies, every layer's K and V of the block, in
  host-slot order).  The fingerprint is keyed by the destination host block id;
  rewriting a host block replaces it.  (The worker never hears of evictions, a
  scheduler-side event: an evicted host block keeps its bytes and fingerprint
  until a store rewrites both.)
* load: ``submit_load`` takes the current fingerprints of its host blocks; when
  ``get_finished`` sees the H2D copy complete, the DESTINATION GPU blocks are
  fingerprinted on a separate stream (after the copy), synchronously read back
  and compared.  Each block counts in ``stats.verified_blocks``; one whose
  fingerprint differs, or whose host block was never stored, also counts in
  ``stats.verify_mismatch_blocks`` and is logged at error level.
This checks the data path (GPU -> ring -> host -> GPU bytes); which key lives in
which host block is the manager's bookkeeping, checked by the scheduler tests.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from ion_vllm.kv_tier.runtime import CudaRuntime, SimRuntime
from ion_vllm.kv_tier import page_gather
from ion_vllm.kv_tier.raw_issue import CudaMemcpy, HostMemmove, IdStage, PointerDrain, runs
from ion_vllm.kv_tier.staging_ring import (
    StagingRing,
    check_gather_ids,
    check_gather_priority,
    check_gather_stream,
    check_host_delay,
    check_host_layout,
    check_id_upload,
    check_issue_api,
    check_issue_at,
    check_load_copy,
    check_overflow,
    check_ring_gather,
    check_ring_idle,
    check_ring_shape,
    check_store_batch,
    check_store_completion,
)
from ion_vllm.kv_tier.stats import PROCESS_COUNTERS, WorkerStats
from ion_vllm.kv_tier.trace_ranges import traced

logger = logging.getLogger(__name__)

ENV_VERIFY = "ION_KV_TIER_VERIFY"


def verify_from_env() -> bool:
    return os.environ.get(ENV_VERIFY, "").strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------
def _rows(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """View a blocks-first tensor as (num_blocks, bytes) int8 without copying."""
    assert t.shape[0] == num_blocks
    inner = t[0] if num_blocks else t
    if not inner.is_contiguous():
        raise ValueError("the bytes of one KV block must be contiguous")
    nbytes = inner.numel() * t.element_size()
    raw = torch.empty(0, dtype=torch.int8, device=t.device).set_(t.untyped_storage())
    return torch.as_strided(
        raw, (num_blocks, nbytes), (t.stride(0) * t.element_size(), 1),
        t.storage_offset() * t.element_size(),
    )


def canonicalize_layer_caches(
    caches: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    num_blocks: int,
    layout: str = "auto",
) -> CanonicalKVCaches:
    """Build CanonicalKVCaches (single KV group) from per-layer KV tensors.

    layout: "blocks_first" ([num_blocks, ...], e.g. ION [num_blocks, 2, Hkv, P, D]),
    "kv_first" ([2, num_blocks, ...], e.g. [2, num_blocks, P, Hkv, D]) or "auto"
    (dim 0 == num_blocks -> blocks_first, else dim 0 == 2 and dim 1 ==
    num_blocks -> kv_first).  Layers sharing storage are kept once.
    """
    tensors = list(caches.values()) if isinstance(caches, Mapping) else list(caches)
    out: list[CanonicalKVCacheTensor] = []
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        lay = layout
        if lay == "auto":
            if t.shape[0] == num_blocks and not (num_blocks == 2 and t.ndim > 1 and t.shape[1] == 2):
                lay = "blocks_first"
            elif t.shape[0] == 2 and t.ndim > 1 and t.shape[1] == num_blocks:
                lay = "kv_first"
            else:
                raise ValueError(f"cannot find num_blocks={num_blocks} in shape {tuple(t.shape)}")
        parts = [t] if lay == "blocks_first" else [t[0], t[1]]
        for p in parts:
            key = (p.data_ptr(), p.stride(0))
            if key in seen:
                continue
            seen.add(key)
            r = _rows(p, num_blocks)
            out.append(CanonicalKVCacheTensor(tensor=r, page_size_bytes=r.shape[1]))
    refs = [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=c.page_size_bytes)
            for i, c in enumerate(out)]
    return CanonicalKVCaches(tensors=out, group_data_refs=[refs])


# --------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------
class TorchCopier:
    """Block copies with plain torch ops; any device (CPU tests, CUDA fallback).

    The host pool and the ring are ``[rows, slot_bytes]`` int8 buffers.  ``layout``
    says where tensor ``t``'s page of row ``r`` lives (``view``):
    * ``"slot"``: row ``r`` holds one block, every tensor's page at ``offsets[t]``;
    * ``"tensor"``: the buffer is ``len(tensors)`` regions, one per tensor, each
      ``[rows, page_bytes[t]]``; a run of consecutive blocks of one tensor is then one
      contiguous range, as it is in the GPU tensor (vLLM's native CPU worker keeps one
      host tensor per KV tensor the same way).
    """

    name = "torch"

    def __init__(self, tensors: list[torch.Tensor], offsets: list[int],
                 group_refs: list[list[tuple[int, int]]], layout: str = "slot",
                 page_bytes: Sequence[int] | None = None):
        self.tensors = tensors
        self.offsets = offsets
        self.group_refs = group_refs
        self.layout = check_host_layout(layout)
        if page_bytes is None:  # widest page each tensor is copied with
            page_bytes = [0] * len(tensors)
            for g in group_refs:
                for t, nb in g:
                    page_bytes[t] = max(page_bytes[t], nb)
        self.page_bytes = [int(x) for x in page_bytes]

    def placement(self, buf: torch.Tensor, t: int) -> tuple[int, int]:
        """(byte offset of row 0, row stride in bytes) of tensor ``t``'s pages in a
        host/ring buffer."""
        if self.layout == "slot":
            return self.offsets[t], buf.stride(0)
        return buf.shape[0] * self.offsets[t], self.page_bytes[t]

    def view(self, buf: torch.Tensor, t: int, nb: int | None = None) -> torch.Tensor:
        """``[rows, nb]`` view of tensor ``t``'s pages in a host/ring buffer."""
        nb = self.page_bytes[t] if nb is None else nb
        off, stride = self.placement(buf, t)
        return torch.as_strided(buf, (buf.shape[0], nb), (stride, 1),
                                buf.storage_offset() + off)

    def gather(self, ring: torch.Tensor, start: int, group: int,
               gpu_ids: np.ndarray) -> None:
        n = len(gpu_ids)
        for t, nb in self.group_refs[group]:
            src = self.tensors[t]
            idx = torch.from_numpy(gpu_ids).to(src.device)
            self.view(ring, t, nb)[start:start + n].copy_(src.index_select(0, idx)[:, :nb])

    def drain(self, ring: torch.Tensor, start: int, host: torch.Tensor,
              host_ids: np.ndarray) -> None:
        slots = np.arange(start, start + len(host_ids))
        for i0, i1, s0, h0 in runs(slots, host_ids):
            n = i1 - i0
            if self.layout == "slot":  # whole slots: one copy per run
                host[h0:h0 + n].copy_(ring[s0:s0 + n], non_blocking=True)
                continue
            for t in range(len(self.tensors)):
                self.view(host, t)[h0:h0 + n].copy_(self.view(ring, t)[s0:s0 + n],
                                                    non_blocking=True)

    def to_host(self, host: torch.Tensor, group: int, gpu_ids: np.ndarray,
                host_ids: np.ndarray) -> None:
        for t, nb in self.group_refs[group]:
            src, dst = self.tensors[t], self.view(host, t, nb)
            for i0, i1, g0, h0 in runs(gpu_ids, host_ids):
                n = i1 - i0
                dst[h0:h0 + n].copy_(src[g0:g0 + n, :nb], non_blocking=True)

    def to_gpu(self, host: torch.Tensor, group: int, host_ids: np.ndarray,
               gpu_ids: np.ndarray) -> None:
        for t, nb in self.group_refs[group]:
            dst, src = self.tensors[t], self.view(host, t, nb)
            for i0, i1, h0, g0 in runs(host_ids, gpu_ids):
                n = i1 - i0
                dst[g0:g0 + n, :nb].copy_(src[h0:h0 + n], non_blocking=True)


class BatchCopier(TorchCopier):
    """CUDA: all block x layer copies of one call in one driver call
    (vLLM's swap_blocks_batch -> cuMemcpyBatchAsync).  Where a tensor's rows are
    contiguous on both sides (GPU row stride == host/ring row stride == page bytes,
    e.g. the ``tensor`` layout, or a single cross-layer KV tensor), a run of
    consecutive blocks is one descriptor."""

    name = "batch"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        from vllm import _custom_ops as ops

        self._swap = ops.swap_blocks_batch
        self._base = [t.data_ptr() for t in self.tensors]
        self._stride = [t.stride(0) for t in self.tensors]

    def _submit(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                src_any: bool) -> None:
        if len(src) == 0:
            return
        self._swap(torch.from_numpy(src.astype(np.int64)),
                   torch.from_numpy(dst.astype(np.int64)),
                   torch.from_numpy(sizes.astype(np.int64)),
                   is_src_access_order_any=src_any)

    def _ptrs(self, group: int, gpu_ids: np.ndarray, buf: torch.Tensor,
              other_ids: np.ndarray):
        """(GPU addresses, host/ring addresses, sizes) of the copies of ``group``'s
        tensors between GPU blocks ``gpu_ids`` and rows ``other_ids`` of ``buf``."""
        src, dst, sz = [], [], []
        g = gpu_ids.astype(np.int64)
        o = other_ids.astype(np.int64)
        for t, nb in self.group_refs[group]:
            off, os_ = self.placement(buf, t)
            base, gs = buf.data_ptr() + off, self._stride[t]
            if gs == nb and os_ == nb:  # contiguous on both sides: one copy per run
                rs = runs(g, o)
                src.append(np.array([self._base[t] + a * gs for _, _, a, _ in rs],
                                    dtype=np.int64))
                dst.append(np.array([base + b * os_ for _, _, _, b in rs], dtype=np.int64))
                sz.append(np.array([(i1 - i0) * nb for i0, i1, _, _ in rs], dtype=np.int64))
            else:
                src.append(self._base[t] + g * gs)
                dst.append(base + o * os_)
                sz.append(np.full(len(g), nb, dtype=np.int64))
        return np.concatenate(src), np.concatenate(dst), np.concatenate(sz)

    def gather(self, ring, start, group, gpu_ids):
        slots = np.arange(start, start + len(gpu_ids))
        s, d, z = self._ptrs(group, gpu_ids, ring, slots)
        self._submit(s, d, z, src_any=False)

    def to_host(self, host, group, gpu_ids, host_ids):
        s, d, z = self._ptrs(group, gpu_ids, host, host_ids)
        self._submit(s, d, z, src_any=False)

    def to_gpu(self, host, group, host_ids, gpu_ids):
        g_ptr, h_ptr, z = self._ptrs(group, gpu_ids, host, host_ids)
        self._submit(h_ptr, g_ptr, z, src_any=True)


# --------------------------------------------------------------------------
# block fingerprints (verify mode)
# --------------------------------------------------------------------------
FP_PRIME = (1 << 31) - 1  # Mersenne prime


class BlockFingerprinter:
    """Fingerprint of a KV block as it sits in a host slot, computed with plain
    torch integer ops on any device (exact, so CPU and CUDA agree bit for bit).

    The slot's bytes are read as words ``w_i`` (unsigned 16-bit, or bytes when
    some page size or offset is odd), ``i`` = word index within the slot; the
    fingerprint is ``(sum w_i mod P) * P + (sum (i + 1) * w_i mod P)`` with P
    = 2^31 - 1.  A changed word (any flipped byte) changes the second sum by
    ``(i + 1) * delta``, both factors nonzero and below the prime, so it is
    always caught; so is a swap of two different words (``(i - j) * (w_j - w_i)``),
    hence swapped rows / layers / K and V.  The per-tensor parts use the
    tensor's offset in the slot, so GPU blocks (one row per canonical tensor)
    and a host slot (one contiguous row) give the same value.
    """

    CHUNK_BYTES = 64 << 20  # bound on the int64 temporaries of one call

    def __init__(self, page_bytes: Sequence[int], offsets: Sequence[int]):
        self.page_bytes = [int(x) for x in page_bytes]
        self.offsets = [int(x) for x in offsets]
        even = all(x % 2 == 0 for x in self.page_bytes + self.offsets)
        self.word = 2 if even else 1
        self._weights: dict[tuple[int, int, str], torch.Tensor] = {}

    def prepare(self, device: torch.device) -> None:
        """Build the position weights of every canonical tensor now (on the current
        stream, then synchronized), so that fingerprints on side streams never
        read weights still being written by another stream."""
        for off, nb in zip(self.offsets, self.page_bytes):
            self._w(off // self.word, nb // self.word, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _w(self, w0: int, n: int, device: torch.device) -> torch.Tensor:
        key = (w0, n, str(device))
        w = self._weights.get(key)
        if w is None:
            w = torch.arange(w0 + 1, w0 + 1 + n, dtype=torch.int64, device=device)
            self._weights[key] = w
        return w

    def part(self, rows: torch.Tensor, byte_offset: int) -> torch.Tensor:
        """(n, 2) int64 partial sums (each < 2^62) of int8 rows (n, nbytes) that sit
        at byte_offset of their slots."""
        assert rows.dtype == torch.int8 and rows.ndim == 2
        n, nb = rows.shape
        if nb % self.word or byte_offset % self.word:
            raise ValueError("fingerprint: rows not aligned to the word size")
        out = torch.zeros((n, 2), dtype=torch.int64, device=rows.device)
        if nb == 0 or n == 0:
            return out
        rows = rows.contiguous()
        words = rows.view(torch.int16) if self.word == 2 else rows
        bias = 1 << (8 * self.word - 1)
        wt = self._w(byte_offset // self.word, words.shape[1], rows.device)
        step = max(1, self.CHUNK_BYTES // (8 * words.shape[1]))
        for a in range(0, n, step):
            x = words[a:a + step].to(torch.int64) + bias  # 0 <= x < 2^16
            out[a:a + step, 0] = x.sum(1)
            out[a:a + step, 1] = ((x * wt) % FP_PRIME).sum(1)
        return out

    @staticmethod
    def finish(acc: torch.Tensor) -> torch.Tensor:
        """(n, 2) partial sums -> (n, 2) int64 fingerprint pair, reduced mod P."""
        return acc % FP_PRIME

    def slots(self, rows: torch.Tensor) -> torch.Tensor:
        """Fingerprints (n, 2) of whole slots (a host pool / ring view)."""
        return self.finish(self.part(rows, 0))

    @staticmethod
    def to_ints(fp: torch.Tensor) -> list[int]:
        """(n, 2) fingerprint pairs (on the CPU) -> one int per block."""
        return [int(a) * FP_PRIME + int(b) for a, b in fp.cpu().tolist()]


class _FpBatch:
    """Fingerprints of a run of blocks, computed on a stream; readable once
    ``event`` (recorded after the computation) has completed."""

    __slots__ = ("event", "tensor", "values")

    def __init__(self):
        self.tensor: torch.Tensor | None = None
        self.event: Any = None
        self.values: list[int] | None = None

    def resolve(self, rt: Any, readback: Any) -> list[int]:
        """Wait for the computation, read the values back once (``readback``: device
        tensor -> CPU tensor) and free the device copy."""
        if self.values is None:
            rt.sync(self.event)
            assert self.tensor is not None, "fingerprint never computed"
            self.values = BlockFingerprinter.to_ints(readback(self.tensor))
            self.tensor = None
        return self.values


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------
@dataclass
class _Piece:
    job: "_StoreJob"
    first: int
    count: int
    ring_run: tuple[int, int] | None  # None: bypass (direct GPU -> host)
    read_done: Any  # event: the GPU source blocks have been read
    start: Any  # event: the host copy starts (the drain, for a ring piece)
    end: Any  # event: the bytes are on the host
    fp: _FpBatch | None = None  # verify mode: fingerprints of the source blocks
    spill: bool = False  # a direct piece issued at submit (ring full), not at a flush
    src_start: Any = None  # ring piece: event before its D2D gather


@dataclass
class _StoreJob:
    job_id: int
    groups: np.ndarray
    gpu: np.ndarray
    host: np.ndarray
    nbytes: int
    next_item: int = 0
    deferred_counted: bool = False
    pieces: list[_Piece] = field(default_factory=list)
    # issue_at="finish": the compute stream's end at submit time (rt.mark_current); the
    # job's copies wait for it, not for whatever the compute stream holds when issued
    after: Any = None
    # store batching: the held jobs (job_id, nbytes) this job issues as one; None: itself
    members: list[tuple[int, int]] | None = None

    @property
    def n(self) -> int:
        return len(self.gpu)


@dataclass
class _LoadJob:
    job_id: int
    nbytes: int
    n: int
    start: Any
    end: Any
    # verify mode: the blocks and the host blocks' fingerprints at submit time
    groups: np.ndarray | None = None
    gpu: np.ndarray | None = None
    host: np.ndarray | None = None
    expected: list[tuple[_FpBatch, int] | None] | None = None


def _spin(seconds: float) -> None:
    """Busy host time (the GIL held, as the tier's own Python work holds it): the
    test-only host-time probe."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


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


def _group_runs(groups: np.ndarray, a: int, b: int):
    """Yield (group, i0, i1) for maximal same-group runs of positions [a, b)."""
    i = a
    while i < b:
        g = int(groups[i])
        j = i + 1
        while j < b and groups[j] == g:
            j += 1
        yield g, i, j
        i = j


class IonKVTierWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        num_host_blocks: int,
        ring_bytes: int,
        runtime: Any | None = None,
        copier: str = "auto",
        pin_memory: bool | None = None,
        log_interval_s: float = 30.0,
        verify: bool | None = None,
        overflow: str = "direct",
        completion: str = "read",
        host_layout: str = "slot",
        ring_gather: str = "auto",
        load_copy: str = "copier",
        issue_at: str = "submit",
        id_upload: str = "pin_memory",
        host_delay_us: float = 0.0,
        host_delay_at: str = "submit",
        issue_api: str = "raw",
        gather_priority: str = "high",
        drain_chunk_bytes: int = 0,
        ring_max_job_blocks: int = 0,
        gather_stream: str = "compute",
        gather_ids: str = "device",
        store_batch_blocks: int = 0,
        store_batch_steps: int = 8,
        ring_idle: bool = False,
    ):
        self.overflow = check_overflow(overflow)
        # test-only probe (spec key ring_idle): the ring is made (its HBM, its gather
        # compiled) but no store uses it; every block is copied GPU -> host directly
        self.ring_idle = check_ring_idle(ring_idle, self.overflow, ring_bytes)
        self.issue_api = check_issue_api(issue_api)
        raw = self.issue_api == "raw"
        self.gather_priority = check_gather_priority(gather_priority)
        self.drain_chunk_bytes, self.ring_max_job_blocks = check_ring_shape(
            drain_chunk_bytes / 1024, ring_max_job_blocks, self.issue_api)
        self.gather_stream = check_gather_stream(gather_stream)
        self.gather_ids = check_gather_ids(gather_ids, self.issue_api)
        self.store_batch_blocks, self.store_batch_steps = check_store_batch(
            store_batch_blocks, store_batch_steps)
        self._held: list[_StoreJob] = []  # store batching: small jobs not yet issued
        self._held_age = 0  # get_finished calls since the oldest held job came
        self._batch_of: dict[int, int] = {}  # job id -> key of the batch that issued it
        self._next_batch_key = -1  # batches are keyed apart from vLLM's job ids (>= 0)
        # test-only host-time probe (spec keys host_delay_us / host_delay_at): extra host
        # time per store job, spent in submit_store or in the next get_finished
        us, self.host_delay_at = check_host_delay(host_delay_us, host_delay_at)
        self._host_delay_s = us * 1e-6
        self._host_delay_owed = 0  # store jobs whose delay the next get_finished spends
        self.issue_at = check_issue_at(issue_at)
        self.id_upload = check_id_upload(id_upload)
        # submitted, not yet issued (issue_at="finish"): ("store", job) / ("load", args)
        self._submitted: deque[tuple[str, Any]] = deque()
        self.completion = check_store_completion(completion, "completion")
        if not kv_caches.tensors:
            raise ValueError("no KV cache tensors")
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
        # issue_api="raw" (raw_issue.py): drains as pointer copies on explicit streams, and
        # the copy kernels launched through their compiled launchers with staged ids
        self._ptr_copy: Any = None
        if raw:
            try:
                self._ptr_copy = CudaMemcpy() if is_cuda else HostMemmove()
            except OSError as e:
                unused = [k for k, on in (
                    ("drain_chunk_kib: the torch drain copies whole runs",
                     self.drain_chunk_bytes),
                    ("gather_ids='host': the torch gather uploads its ids",
                     self.gather_ids == "host")) if on]
                logger.warning("Ion KV tier: issue_api='raw' needs the CUDA runtime "
                               "library (%s); issuing through PyTorch instead%s", e,
                               f" (not applied: {'; '.join(unused)})" if unused else "")
                raw, self.issue_api = False, "torch"
                self.gather_ids = "device"
        self.rt = runtime if runtime is not None else (
            CudaRuntime(self.device, lean=raw) if is_cuda else SimRuntime(eager=True))
        if copier == "auto":
            copier = "torch"
            if is_cuda:
                try:
                    import vllm._custom_ops as ops  # noqa: F401

                    if hasattr(torch.ops, "_C_cache_ops") and hasattr(
                            torch.ops._C_cache_ops, "swap_blocks_batch"):
                        copier = "batch"
                except Exception:  # pragma: no cover - missing vLLM CUDA ops
                    copier = "torch"
        cls = BatchCopier if copier == "batch" else TorchCopier
        self.host_layout = check_host_layout(host_layout)
        self.copier = cls(self.tensors, self.offsets, group_refs, layout=self.host_layout,
                          page_bytes=self.page_bytes)
        if pin_memory is None:
            pin_memory = is_cuda
        self.num_host_blocks = num_host_blocks
        t0 = time.monotonic()
        self.host = torch.empty((num_host_blocks, self.slot_bytes), dtype=torch.int8,
                                device="cpu", pin_memory=pin_memory)
        logger.info("Ion KV tier: %d host blocks x %d B = %.2f GiB pinned=%s (%.1fs)",
                    num_host_blocks, self.slot_bytes,
                    num_host_blocks * self.slot_bytes / 2**30, pin_memory,
                    time.monotonic() - t0)
        self.ring = StagingRing(ring_bytes, self.slot_bytes, self.device)
        if self.ring.num_slots == 0 and self.overflow != "direct":
            raise ValueError("Ion KV tier: a ring of no slots (ring 0 MiB) needs "
                             "overflow='direct': deferred blocks would wait forever")
        self._raw_ids = IdStage(self.device, self._ptr_copy) if raw and is_cuda else None
        # gather_ids="host": the ring gather reads its ids from pinned memory (no copy)
        self._gather_id_stage = (IdStage(self.device, self._ptr_copy, mapped=True)
                                 if self._raw_ids is not None and self.gather_ids == "host"
                                 else self._raw_ids)
        self._ptr_drain = PointerDrain(
            self.ring.buffer, self.host, self.host_layout, self.copier.placement,
            self.page_bytes, self._ptr_copy, chunk_bytes=self.drain_chunk_bytes,
            batch=self._batch_drain if isinstance(self.copier, BatchCopier) else None,
        ) if raw else None
        self._raw_gather: page_gather.PageGather | None = None
        self._raw_load: page_gather.HostPageCopy | None = None
        self.ring_gather = self._ring_gather_fn(check_ring_gather(ring_gather), is_cuda)
        self.load_to_gpu = self._load_copy_fn(check_load_copy(load_copy), is_cuda)
        logger.info("Ion KV tier: ring of %d slots (%d MiB), GPU -> ring by %s, "
                    "host -> GPU by %s", self.ring.num_slots, self.ring.nbytes >> 20,
                    self.ring_gather_impl, self.load_copy_impl)
        # gather_stream="drain": the gather (and flush bypasses) queue on the drain stream,
        # the one stream the direct GPU -> host copies use (streams made in the same order);
        # "compute": the gather on the compute stream as it is at issue time (_d2d None),
        # flush bypasses (GPU -> host copies) on the drain stream
        own = self.gather_stream == "own"
        if not own and self.gather_priority != "high":
            logger.warning("Ion KV tier: gather_priority=%r not applied: only "
                           "gather_stream='own' gives the gather a stream of its own "
                           "(gather_stream=%r)", self.gather_priority, self.gather_stream)
        d2d = self.rt.new_stream(high_priority=self.gather_priority == "high") if own else None
        self._drain = self.rt.new_stream(high_priority=False)
        self._d2d = d2d if own else (self._drain if self.gather_stream == "drain" else None)
        self._bypass_stream = self._d2d if self._d2d is not None else self._drain
        self._load = self.rt.new_stream(high_priority=False)
        self._queue: deque[_StoreJob] = deque()  # jobs with blocks not yet issued
        self._ring_pieces: deque[_Piece] = deque()  # holding ring slots, FIFO
        self._stores: dict[int, _StoreJob] = {}
        self._loads: dict[int, _LoadJob] = {}
        self._host_pending: dict[int, Any] = {}  # host id -> end event of its write
        self.stats = WorkerStats(ring_slots=self.ring.num_slots)
        self._log_interval = log_interval_s
        self._last_log = time.monotonic()
        self.verify = verify_from_env() if verify is None else bool(verify)
        self._fp_by_host: dict[int, tuple[_FpBatch, int]] = {}
        if self.verify:
            self.fingerprinter = BlockFingerprinter(self.page_bytes, self.offsets)
            self._group_refs = group_refs
            self._verify_stream = self.rt.new_stream(high_priority=False)
            self.fingerprinter.prepare(self.device)
            logger.warning(
                "Ion KV tier: VERIFY mode on (%s / kv_connector_extra_config verify): "
                "every stored and restored KV block is fingerprinted on %s and compared; "
                "this costs GPU time and a sync per finished load - a test mode",
                ENV_VERIFY, self.device)

    def _batch_drain(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray,
                     stream: Any) -> None:
        """The chunked drain's pieces in one driver call on ``stream`` (``BatchCopier``)."""
        copier = self.copier
        assert isinstance(copier, BatchCopier)
        self.rt.launch(stream, lambda: copier._submit(src, dst, sizes, src_any=False))

    def _kernel_or_copier(self, key: str, choice: str, usable: bool, needs: dict[str, bool],
                          build, prepare, fallback, what: str) -> tuple[str, Any]:
        """The choice between a Triton kernel and the copier's copy for one copy path
        (config key ``key``): ``"auto"`` takes the kernel when ``usable``; ``"kernel"``
        is refused (ValueError) when one of ``needs`` (requirement -> met) is not met;
        ``build()`` makes the kernel object (its ValueError: a KV layout the kernel
        cannot address, raised under ``"kernel"``, logged and answered with ``fallback``
        under ``"auto"``); ``prepare(obj)`` compiles it (now, then synchronized, not
        inside the first forward step that copies) and returns its copy function.
        Returns (impl name, function)."""
        auto = choice == "auto"
        if auto:
            choice = "kernel" if usable else "copier"
        if choice == "copier":
            return "copier", fallback
        for need, met in needs.items():
            if not met:
                raise ValueError(f"Ion KV tier: {key}='kernel' needs {need}")
        try:
            obj = build()
        except ValueError as e:  # a KV layout the kernel cannot address (alignment)
            if not auto:
                raise
            logger.warning("Ion KV tier: %s on the copy engines (%s)", what, e)
            return "copier", fallback
        fn = prepare(obj)
        torch.cuda.synchronize(self.device)
        return "kernel", fn

    def _ring_gather_fn(self, choice: str, is_cuda: bool):
        """The GPU -> ring copy of ``_issue_ring_piece``: ``"kernel"`` (one Triton launch
        on the SMs, ``page_gather``), ``"copier"`` (the copier's own gather: one
        copy-engine descriptor per page with the batch copier) or ``"auto"`` (the kernel
        on CUDA with Triton, else the copier).  A ring of no slots gathers nothing: the
        copier."""
        def build():
            return page_gather.PageGather(self.tensors, self.copier.group_refs,
                                          self.copier.placement, self.ring.buffer,
                                          staged_ids=self.id_upload == "staged",
                                          raw_ids=self._gather_id_stage)

        def prepare(gather):
            gather.warm_up()  # compile (Triton JIT) every group's kernel now
            if self._raw_ids is not None and gather.raw_ready():
                self._raw_gather = gather
            elif self._raw_ids is not None:
                logger.warning("Ion KV tier: no compiled launcher for the ring gather; it "
                               "is launched through Triton's dispatcher instead")
            return gather

        if self.ring.num_slots == 0:
            choice = "copier"
        self.ring_gather_impl, fn = self._kernel_or_copier(
            "ring_gather", choice, is_cuda and page_gather.available(),
            {"a CUDA KV cache": is_cuda}, build, prepare, self.copier.gather,
            "GPU -> ring gather")
        return fn

    def _load_copy_fn(self, choice: str, is_cuda: bool):
        """The host -> GPU copy of ``submit_load``: ``"kernel"`` (``HostPageCopy``: a few
        persistent Triton programs that read the pinned host pool directly, so that no
        load sits in the copy-engine queue in front of the forward pass's own host ->
        GPU copies), ``"copier"`` (the copier's ``to_gpu``) or ``"auto"`` (the kernel on
        CUDA with Triton and a pinned host pool, else the copier)."""
        def build():
            return page_gather.HostPageCopy(self.tensors, self.copier.group_refs,
                                            self.copier.placement, self.host, self.device,
                                            staged_ids=self.id_upload == "staged",
                                            raw_ids=self._raw_ids)

        def prepare(hpc):
            hpc.warm_up()
            if self._raw_ids is not None and hpc.raw_ready():
                self._raw_load = hpc
            elif self._raw_ids is not None:
                logger.warning("Ion KV tier: no compiled launcher for the load kernel; it "
                               "is launched through Triton's dispatcher instead")
            return hpc.to_gpu

        pinned = self.host.is_pinned()
        self.load_copy_impl, fn = self._kernel_or_copier(
            "load_copy", choice, is_cuda and page_gather.available() and pinned,
            {"a CUDA KV cache": is_cuda, "a pinned host pool": pinned}, build, prepare,
            self.copier.to_gpu, "host -> GPU loads")
        return fn

    def _nbytes(self, groups: np.ndarray) -> int:
        """Bytes of the blocks whose KV groups are ``groups`` (one entry per block)."""
        return int(sum(self.group_bytes[g] for g in groups))

    # ------------------------------------------------------------ stores
    @traced("ion_kv:submit_store")
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        groups, gpu, host = _flatten(src_spec, dst_spec)
        nbytes = self._nbytes(groups)
        job = _StoreJob(job_id, groups, gpu, host, nbytes)
        self._stores[job_id] = job
        self.stats.store_jobs += 1
        if self._host_delay_s:
            if self.host_delay_at == "submit":
                _spin(self._host_delay_s)
            else:
                self._host_delay_owed += 1
        if self.issue_at == "submit":
            self._issue_store(job)
        else:
            job.after = self.rt.mark_current()
            self._submitted.append(("store", job))
        return True

    def _issue_store(self, job: _StoreJob) -> None:
        k = self.store_batch_blocks
        if k and job.n < k:
            if not self._held:
                self._held_age = 0
            self._held.append(job)
            if sum(j.n for j in self._held) >= k:  # fewer than k jobs: a short sum
                self._release_held()
            return
        self._release_held()  # held jobs first: submission order
        self._queue.append(job)
        self._pump()

    def _release_held(self) -> None:
        """Issue the held store jobs (store batching) as one job: their blocks in one
        gather and drain (or one direct copy), grouped by KV group, keyed apart from
        vLLM's ids; ``get_finished`` reports each member under its own id."""
        held = self._held
        if not held:
            return
        self._held = []
        if len(held) == 1:
            unit = held[0]
        else:
            groups = np.concatenate([j.groups for j in held])
            order = np.argsort(groups, kind="stable")
            key = self._next_batch_key
            self._next_batch_key -= 1
            unit = _StoreJob(key, groups[order],
                             np.concatenate([j.gpu for j in held])[order],
                             np.concatenate([j.host for j in held])[order],
                             sum(j.nbytes for j in held), after=held[-1].after,
                             members=[(j.job_id, j.nbytes) for j in held])
            for j in held:
                del self._stores[j.job_id]
                self._batch_of[j.job_id] = key
            self._stores[key] = unit
            self.stats.store_batches += 1
            self.stats.batched_store_jobs += len(held)
        self._queue.append(unit)
        self._pump()

    def _after_compute(self, stream: Any, job: _StoreJob) -> None:
        """Order work queued next on ``stream`` after the compute stream's work that
        produced ``job``'s blocks: its mark from submit time (issue_at="finish"), else
        everything the compute stream holds now (issued at submit, that is the same)."""
        if job.after is not None:
            self.rt.wait_mark(stream, job.after)
        else:
            self.rt.wait_current(stream)

    def _issue_submitted(self) -> None:
        """Issue every submitted transfer not yet issued, in submission order (see
        "Issue" in the module docstring)."""
        while self._submitted:
            kind, item = self._submitted.popleft()
            if kind == "store":
                self._issue_store(item)
            else:
                self._issue_load(*item)

    # ------------------------------------------------------------ verify
    def _fingerprint_gpu(self, groups: np.ndarray, gpu: np.ndarray) -> torch.Tensor:
        """(n, 2) fingerprints of GPU blocks ``gpu`` (of KV groups ``groups``),
        computed on the current stream from the bytes the copies move."""
        fpr = self.fingerprinter
        idx = torch.from_numpy(np.ascontiguousarray(gpu, dtype=np.int64))
        if self.device.type == "cuda":  # async H2D: never block the host on the stream
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        acc = torch.zeros((len(gpu), 2), dtype=torch.int64, device=self.device)
        for g, i0, i1 in _group_runs(groups, 0, len(gpu)):
            for t, nb in self._group_refs[g]:
                rows = self.tensors[t].index_select(0, idx[i0:i1])[:, :nb]
                acc[i0:i1] += fpr.part(rows, self.offsets[t])
        return fpr.finish(acc)

    def _readback(self, t: torch.Tensor) -> torch.Tensor:
        """Device -> CPU copy of a finished fingerprint.  On CUDA it goes through the
        verify stream, which holds no unfinished work here (every use of it is
        synchronized at once), so the host never waits on the forward pass."""
        if t.is_cuda and isinstance(self._verify_stream, torch.cuda.Stream):
            with torch.cuda.stream(self._verify_stream):
                return t.cpu()
        return t.cpu()

    def _launch_store_fingerprint(self, stream: Any, job: _StoreJob, a: int,
                                  b: int) -> _FpBatch:
        """Queue the fingerprint of the source blocks of items [a, b) on the
        stream that reads them for the copy (before its read-done event) and
        key it by their host block ids (replacing older fingerprints)."""
        fp = _FpBatch()
        groups, gpu = job.groups[a:b], job.gpu[a:b]

        def run():
            fp.tensor = self._fingerprint_gpu(groups, gpu)

        self.rt.launch(stream, run)
        for k, h in enumerate(job.host[a:b].tolist()):
            self._fp_by_host[h] = (fp, k)
        self.stats.fingerprinted_store_blocks += b - a
        return fp

    def _verify_load(self, ld: _LoadJob) -> None:
        """The H2D copy of ``ld`` has completed: fingerprint the destination GPU
        blocks (on the verify stream, after the copy), read back, compare."""
        assert ld.gpu is not None and ld.groups is not None and ld.expected is not None
        rt = self.rt
        got = _FpBatch()

        def run():
            got.tensor = self._fingerprint_gpu(ld.groups, ld.gpu)

        rt.wait_event(self._verify_stream, ld.end)
        rt.launch(self._verify_stream, run)
        got.event = rt.record(self._verify_stream)
        values = got.resolve(rt, self._readback)
        bad = 0
        for k, (exp, h, g) in enumerate(zip(ld.expected, ld.host.tolist(), ld.gpu.tolist())):
            if exp is None:
                self.stats.verify_unknown_blocks += 1
                bad += 1
                logger.error("Ion KV tier VERIFY: load job %d restored host block %d into "
                             "GPU block %d, but no store of that host block was seen",
                             ld.job_id, h, g)
                continue
            want = exp[0].resolve(rt, self._readback)[exp[1]]
            if values[k] != want:
                bad += 1
                logger.error("Ion KV tier VERIFY MISMATCH: load job %d, host block %d -> "
                             "GPU block %d: restored fingerprint %#x != stored %#x",
                             ld.job_id, h, g, values[k], want)
        self.stats.verified_blocks += ld.n
        self.stats.verify_mismatch_blocks += bad
        PROCESS_COUNTERS.verified_blocks += ld.n
        PROCESS_COUNTERS.verify_mismatch_blocks += bad

    # ------------------------------------------------------------ stores
    def _issue_ring_piece(self, job: _StoreJob, start: int, count: int) -> None:
        rt, cp, ring, gather = self.rt, self.copier, self.ring.buffer, self.ring_gather
        a, b = job.next_item, job.next_item + count
        if self._d2d is not None:
            d2d = self._d2d
            self._after_compute(d2d, job)
        else:  # gather_stream="compute": in line with the work that wrote the blocks
            d2d = rt.current_stream()
        src_start = rt.record(d2d)
        raw = self._raw_gather
        for g, i0, i1 in _group_runs(job.groups, a, b):
            ids = job.gpu[i0:i1]
            s = start + (i0 - a)
            if raw is not None:
                rt.launch_on(d2d, lambda st, g=g, ids=ids, s=s:
                             raw.launch_on(st, s, g, ids))
            else:
                rt.launch(d2d, lambda g=g, ids=ids, s=s: gather(ring, s, g, ids))
        fp = self._launch_store_fingerprint(d2d, job, a, b) if self.verify else None
        read_done = rt.record(d2d)
        if fp is not None:
            fp.event = read_done
        rt.wait_event(self._drain, read_done)
        hids = job.host[a:b]
        hlist = hids.tolist()
        self._after_pending_writes(self._drain, hids)
        ev0 = rt.record(self._drain)
        if self._ptr_drain is not None:
            pdrain = self._ptr_drain
            rt.launch_on(self._drain, lambda st: pdrain(start, hlist, st))
        else:
            rt.launch(self._drain, lambda: cp.drain(ring, start, self.host, hids))
        ev1 = rt.record(self._drain)
        p = _Piece(job, a, count, (start, count), read_done, ev0, ev1, fp,
                   src_start=src_start)
        job.pieces.append(p)
        job.next_item = b
        self._ring_pieces.append(p)
        for h in hlist:
            self._host_pending[h] = ev1
        self.stats.d2d_blocks += count
        self.stats.d2d_bytes += count * self.slot_bytes
        PROCESS_COUNTERS.ring_blocks += count
        self.stats.ring_used_slots = self.ring.alloc.used
        self.stats.ring_peak_slots = max(self.stats.ring_peak_slots, self.ring.alloc.used)

    def _issue_spill(self, job: _StoreJob) -> None:
        """``overflow="direct"``: the job's remaining blocks GPU -> host now, on the drain
        stream (low priority) after the compute stream that produced them."""
        n, nbytes = self._issue_direct(job, self._drain, spill=True)
        self.stats.spill_blocks += n
        self.stats.spill_bytes += nbytes
        PROCESS_COUNTERS.spill_blocks += n

    def _issue_bypass(self, job: _StoreJob) -> None:
        """A flush of a job with deferred blocks: copy them GPU -> host now, on the
        gather's stream, or on the drain stream when the gather runs on the compute stream
        (``wait`` then blocks on it)."""
        n, nbytes = self._issue_direct(job, self._bypass_stream, spill=False)
        self.stats.bypass_blocks += n
        self.stats.bypass_bytes += nbytes
        PROCESS_COUNTERS.bypass_blocks += n

    def _issue_direct(self, job: _StoreJob, stream: Any, spill: bool) -> tuple[int, int]:
        """The job's blocks not yet issued, GPU -> host on ``stream`` after the compute
        stream, as one piece; returns (blocks, bytes) issued."""
        rt, cp = self.rt, self.copier
        a, b = job.next_item, job.n
        if a >= b:
            return 0, 0
        self._after_compute(stream, job)
        self._after_pending_writes(stream, job.host[a:b])
        ev0 = rt.record(stream)
        for g, i0, i1 in _group_runs(job.groups, a, b):
            gids, hids = job.gpu[i0:i1], job.host[i0:i1]
            rt.launch(stream, lambda g=g, gids=gids, hids=hids:
                      cp.to_host(self.host, g, gids, hids))
        fp = self._launch_store_fingerprint(stream, job, a, b) if self.verify else None
        ev1 = rt.record(stream)
        if fp is not None:
            fp.event = ev1
        job.pieces.append(_Piece(job, a, b - a, None, ev1, ev0, ev1, fp, spill=spill))
        for h in job.host[a:b].tolist():
            self._host_pending[h] = ev1
        job.next_item = b
        return b - a, self._nbytes(job.groups[a:b])

    def _after_pending_writes(self, stream: Any, host_ids: np.ndarray) -> bool:
        """Order work queued next on ``stream`` after every still-pending write into
        these host blocks (loads read them; with ``completion="read"`` a host block can
        also be evicted and handed to a new store while its old drain still runs).
        Returns whether there was any such write."""
        waits = {id(ev): ev for h in host_ids.tolist()
                 if (ev := self._host_pending.get(h)) is not None}
        for ev in waits.values():
            self.rt.wait_event(stream, ev)
        return bool(waits)

    def _host_written(self, p: _Piece) -> None:
        """``p``'s bytes are in host memory: account its D2H copy and forget the
        pending writes it was the last of."""
        job = p.job
        dt = self.rt.elapsed(p.start, p.end)
        nbytes = self._nbytes(job.groups[p.first:p.first + p.count])
        if p.spill:
            self.stats.spill_seconds += dt
        elif p.ring_run is None:
            self.stats.bypass_seconds += dt
        else:
            self.stats.drained_blocks += p.count
            self.stats.drained_bytes += nbytes
            self.stats.drain_seconds += dt
        PROCESS_COUNTERS.d2h_bytes += nbytes
        PROCESS_COUNTERS.d2h_seconds += dt
        for h in job.host[p.first:p.first + p.count].tolist():
            if self._host_pending.get(h) is p.end:
                del self._host_pending[h]

    def _pump(self) -> None:
        rt = self.rt
        while self._ring_pieces and rt.query(self._ring_pieces[0].end):
            p = self._ring_pieces.popleft()
            assert p.ring_run is not None
            self.ring.alloc.release_oldest(*p.ring_run)
            self._host_written(p)
        while self._queue:
            job = self._queue[0]
            if 0 < self.ring_max_job_blocks < job.n and job.next_item == 0:
                self._issue_spill(job)  # a bulk store: GPU -> host directly
            while job.next_item < job.n and not self.ring_idle:
                run = self.ring.alloc.alloc(job.n - job.next_item)
                if run is None:
                    break
                self._issue_ring_piece(job, *run)
            if job.next_item < job.n and self.overflow == "direct":
                self._issue_spill(job)
            if job.next_item < job.n:
                if not job.deferred_counted:
                    job.deferred_counted = True
                    self.stats.deferred_blocks += job.n - job.next_item
                    PROCESS_COUNTERS.deferred_blocks += job.n - job.next_item
                break
            self._queue.popleft()
        self.stats.ring_used_slots = self.ring.alloc.used

    # ------------------------------------------------------------ loads
    @traced("ion_kv:submit_load")
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        self.stats.load_jobs += 1
        groups, gpu, host = _flatten(dst_spec, src_spec)
        if self.issue_at == "submit":
            self._issue_load(job_id, groups, gpu, host)
        else:
            self._submitted.append(("load", (job_id, groups, gpu, host)))
        return True

    def _issue_load(self, job_id: int, groups: np.ndarray, gpu: np.ndarray,
                    host: np.ndarray) -> None:
        rt, to_gpu = self.rt, self.load_to_gpu
        # no rt.wait_current(self._load): see "Load" in the module docstring
        self.stats.loads_ordered_after_drain += self._after_pending_writes(self._load, host)
        ev0 = rt.record(self._load)
        raw = self._raw_load
        for g, i0, i1 in _group_runs(groups, 0, len(gpu)):
            hids, gids = host[i0:i1], gpu[i0:i1]
            if raw is not None:
                rt.launch_on(self._load, lambda st, g=g, hids=hids, gids=gids:
                             raw.launch_on(st, g, hids, gids))
            else:
                rt.launch(self._load, lambda g=g, hids=hids, gids=gids:
                          to_gpu(self.host, g, hids, gids))
        ev1 = rt.record(self._load)
        nbytes = self._nbytes(groups)
        ld = _LoadJob(job_id, nbytes, len(gpu), ev0, ev1)
        if self.verify:
            ld.groups, ld.gpu, ld.host = groups, gpu, host
            ld.expected = [self._fp_by_host.get(h) for h in host.tolist()]
        self._loads[job_id] = ld

    # ------------------------------------------------------------ completion
    @traced("ion_kv:get_finished")
    def get_finished(self) -> list[TransferResult]:
        if self._host_delay_owed:
            _spin(self._host_delay_s * self._host_delay_owed)
            self._host_delay_owed = 0
        self._issue_submitted()
        if self._held:
            self._held_age += 1
            if self._held_age >= self.store_batch_steps:
                self._release_held()
        self._pump()
        rt = self.rt
        out: list[TransferResult] = []
        read = self.completion == "read"
        for jid, job in list(self._stores.items()):
            if job.next_item < job.n or not all(
                    rt.query(p.read_done if read else p.end) for p in job.pieces):
                continue
            # a direct piece's read_done is its end; a ring piece was accounted by _pump
            # when its drain ended (already, under "host": drains end in order)
            secs = 0.0
            for p in job.pieces:
                if p.fp is not None:
                    p.fp.resolve(rt, self._readback)  # done (before read_done); frees it
                if p.ring_run is None:
                    self._host_written(p)
                    secs += rt.elapsed(p.start, p.end)
                elif read:
                    secs += rt.elapsed(p.src_start, p.read_done)
                else:
                    secs += rt.elapsed(p.start, p.end)
            del self._stores[jid]
            for mid, nb in job.members or [(jid, job.nbytes)]:
                # a batch's time is shared by bytes (vLLM sums it per job)
                out.append(TransferResult(job_id=mid, success=True, transfer_size=nb,
                                          transfer_time=secs * nb / job.nbytes
                                          if job.nbytes else secs))
                self._batch_of.pop(mid, None)
        for jid, ld in list(self._loads.items()):
            if rt.query(ld.end):
                if self.verify:
                    self._verify_load(ld)
                dt = rt.elapsed(ld.start, ld.end)
                self.stats.loaded_blocks += ld.n
                self.stats.loaded_bytes += ld.nbytes
                self.stats.load_seconds += dt
                del self._loads[jid]
                out.append(TransferResult(job_id=jid, success=True,
                                          transfer_size=ld.nbytes, transfer_time=dt))
        self._pump()
        if self._log_interval and time.monotonic() - self._last_log > self._log_interval:
            self._last_log = time.monotonic()
            logger.info("Ion KV tier worker: %s", self.stats.as_dict())
        return out

    @traced("ion_kv:wait")
    def wait(self, job_ids: set[int]) -> None:
        """Return once the GPU source blocks of these jobs may be reused (stores)
        or the loaded blocks are in place (loads)."""
        self._issue_submitted()
        if any(j.job_id in job_ids for j in self._held):
            self._release_held()
        for jid in job_ids:
            ld = self._loads.get(jid)
            if ld is not None:
                self.rt.sync(ld.end)
                continue
            job = self._stores.get(self._batch_of.get(jid, jid))
            if job is None:
                continue
            if job.next_item < job.n:
                try:
                    self._queue.remove(job)
                except ValueError:
                    pass
                self._issue_bypass(job)
            for p in job.pieces:
                self.rt.sync(p.read_done)
        self._pump()

    def shutdown(self) -> None:
        self._issue_submitted()
        self._release_held()
        for job in list(self._stores.values()):
            for p in job.pieces:
                self.rt.sync(p.end)
        for p in self._ring_pieces:  # reported under completion="read", still draining
            self.rt.sync(p.end)
        for ld in self._loads.values():
            self.rt.sync(ld.end)
        self._queue.clear()
        self._ring_pieces.clear()
        if self.verify:
            st = self.stats
            (logger.error if st.verify_mismatch_blocks else logger.warning)(
                "Ion KV tier VERIFY summary: %d restored blocks checked, %d mismatched "
                "(%d without a stored fingerprint), %d stored blocks fingerprinted",
                st.verified_blocks, st.verify_mismatch_blocks, st.verify_unknown_blocks,
                st.fingerprinted_store_blocks)

    # ------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        a = self.ring.alloc
        a.check()
        assert a.used * self.slot_bytes <= self.ring.nbytes, "staging ring overflow"
        assert sum(p.count for p in self._ring_pieces) == a.used, "ring slot leak"
        assert all(j.job_id in self._stores and not j.pieces for j in self._held)
        assert all(k in self._stores for k in self._batch_of.values()), "lost batch"
