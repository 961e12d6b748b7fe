"""KV page copies on the SMs with Triton, not on the copy engines.

Two kernels:

* ``PageGather``: GPU blocks -> ring rows (the store's first step), one launch with a
  program per (block, tensor, chunk);
* ``HostPageCopy``: between GPU blocks and rows of the pinned host pool (loads, host ->
  GPU), read or written through the host buffer's unified address by a fixed, small
  number of persistent programs.

Why loads do not use the copy engines (``cudaMemcpyAsync`` / ``cuMemcpyBatchAsync``):
copies of one direction run in the order they were issued, whatever their stream and
its priority.  Every engine step, vLLM copies the step's inputs host -> GPU on the
compute stream; behind a load in flight that copy waits until the whole load has
crossed PCIe, and the step's kernels with it.  Measured on the H200
(``scripts/copy_contention_probe.py``, ``bench/results/2026-12-04-h200/session21``):
a 64 KiB host -> GPU copy took 38 µs alone and 4,776 µs behind a 256 MiB load (4,360 µs
behind the same load issued as 4 MiB copies); behind the same load done by 8 programs of
``HostPageCopy``'s kind it took 58 µs, at 50.7 GB/s against 54.7 for the copy engine,
and a memory-bound kernel beside it ran 1.9% slower.

Why the gather does not use ``cuMemcpyBatchAsync`` (vLLM's ``swap_blocks_batch``): on the
H200 a batch of device-to-device descriptors of one page each (128 KiB per layer and
block in the ION layout) moved about 7 GB/s (``scripts/kv_tier_copy_bench.py``, the
ring worker's per-job store rate; see ``bench/notes.md``, seventh session), slower than
the PCIe drain behind it.  A gather on the SMs reads and writes HBM at hundreds of
GB/s, so a 3.5 MiB block costs microseconds of SM time instead of half a millisecond of
a copy engine that the H2D loads also need.

Addressing: tensor ``t`` of the KV cache has its page of GPU block ``b`` at
``base[t] + b * stride[t]``; ring row ``r`` holds it at ``ring + roff[t] + r * rstride[t]``
(``TorchCopier.placement``).  Only the GPU block ids travel per call (int64, written into
a persistent pinned buffer and copied asynchronously, ``IdUpload``: no host allocation
per call, and the host never waits on a stream); the per-tensor table is uploaded once
per KV group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

try:  # Triton ships with vLLM; absent only in unusual CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16384  # bytes one program copies; pages are split into chunks of this
ALIGN = 16  # every address and page size must be a multiple (checked on the host)
#: HostPageCopy's programs: 8 moved 50.7 GB/s over the H200's PCIe (16: 50.7 GB/s, and a
#: memory-bound kernel beside them 5.1% slower instead of 1.9%)
HOST_PROGRAMS = 8


if triton is not None:

    # slot0 varies per call: unspecialized, so the warm-up compile at worker start is the
    # only one (Triton would otherwise compile again for slot0 == 1 and for multiples of
    # 16, inside a forward step; vLLM's JIT monitor flagged that on the H200)
    @triton.jit(do_not_specialize=["slot0"])
    def _gather_pages_kernel(ids_ptr, tab_ptr, ring_base, slot0,
                             CHUNK: tl.constexpr):
        """Program (i, t, c): chunk c of tensor t's page of block ids[i] -> ring row
        slot0 + i.  ``tab`` rows: (base, stride, ring offset, ring stride, bytes)."""
        i = tl.program_id(0)
        t = tl.program_id(1)
        c = tl.program_id(2)
        row = tab_ptr + t * 5
        nbytes = tl.load(row + 4)
        start = c * CHUNK
        if start < nbytes:
            blk = tl.load(ids_ptr + i)
            src = tl.load(row + 0) + blk * tl.load(row + 1) + start
            dst = ring_base + tl.load(row + 2) + (slot0 + i) * tl.load(row + 3) + start
            # 8-byte words: addresses and sizes are multiples of 16 (checked on the host)
            src_p = src.to(tl.pointer_type(tl.int64))
            dst_p = dst.to(tl.pointer_type(tl.int64))
            offs = tl.arange(0, CHUNK // 8)
            m = offs < (nbytes - start) // 8
            tl.store(dst_p + offs, tl.load(src_p + offs, mask=m), mask=m)


    # n varies per call: unspecialized (one compile per direction and chunk count)
    @triton.jit(do_not_specialize=["n"])
    def _host_pages_kernel(ids_ptr, n, tab_ptr, ntab, nchunk, host_base,
                           TO_GPU: tl.constexpr, CHUNK: tl.constexpr):
        """Persistent programs over the items (i, t, c) = chunk c of tensor t's page of
        GPU block ids[i] <-> the same bytes of host row ids[n + i]; ``tab`` rows as in
        ``_gather_pages_kernel`` with the host buffer in place of the ring."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        offs = tl.arange(0, CHUNK // 8)
        for w in range(pid, n * ntab * nchunk, nprog):
            c = w % nchunk
            r = w // nchunk
            t = r % ntab
            i = r // ntab
            row = tab_ptr + t * 5
            start = c * CHUNK
            # a chunk past the end of a shorter page copies nothing (mask all false)
            m = offs < (tl.load(row + 4) - start) // 8
            blk = tl.load(ids_ptr + i)
            hrow = tl.load(ids_ptr + n + i)
            gpu = tl.load(row + 0) + blk * tl.load(row + 1) + start
            host = host_base + tl.load(row + 2) + hrow * tl.load(row + 3) + start
            if TO_GPU:
                src = host
                dst = gpu
            else:
                src = gpu
                dst = host
            src_p = src.to(tl.pointer_type(tl.int64))
            dst_p = dst.to(tl.pointer_type(tl.int64))
            tl.store(dst_p + offs, tl.load(src_p + offs, mask=m), mask=m)


def available() -> bool:
    return triton is not None


def _compiled_launch(kernel: Any, what: str) -> Any:
    """``raw_issue.CompiledLaunch`` of what a warm-up launch returned, or None: under
    Triton's interpreter (CPU tests) a launch returns nothing, and a Triton whose compiled
    kernels lack the attributes the launcher needs is logged and left to its dispatcher."""
    from ion_vllm.kv_tier.raw_issue import CompiledLaunch

    if kernel is None:
        return None
    try:
        return CompiledLaunch(kernel)
    except (AttributeError, TypeError) as e:
        logger.warning("Ion KV tier: %s: Triton's compiled kernel has no launcher this "
                       "path can call (%s)", what, e)
        return None


def _page_tables(tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 buf: torch.Tensor, who: str,
                 device: torch.device) -> tuple[list[torch.Tensor], list[int]]:
    """Per KV group, the table (int64 ``[tensors, 5]`` on ``device``) of rows (GPU base,
    GPU row stride, buffer offset, buffer row stride, bytes) of its tensors' pages in
    ``buf``, and the group's widest page; a ValueError when an address or size is not a
    multiple of ALIGN."""
    tables, widest = [], []
    for refs in group_refs:
        rows = []
        for t, nb in refs:
            src = tensors[t]
            off, rstride = placement(buf, t)
            row = [src.data_ptr(), src.stride(0), off, rstride, nb]
            if any(int(x) % ALIGN for x in row) or buf.data_ptr() % ALIGN:
                raise ValueError(f"{who}: tensor {t} is not {ALIGN}-byte aligned "
                                 f"(base, stride, buffer offset, buffer stride, bytes = {row})")
            rows.append(row)
        tables.append(torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 5))
        widest.append(max((nb for _, nb in refs), default=0))
    return tables, widest


def _device_ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 ids as a tensor on ``device``; on CUDA through PyTorch's pinned caching host
    allocator and an async copy, so the host never waits on a stream."""
    t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class StagingRegions:
    """Which part of a persistent staging buffer of ``capacity`` entries the next upload
    may write (a pure rule, no CUDA): regions are handed out one after the other, wrapping
    around the buffer (a region never straddles its end: the tail is skipped instead).  A
    region may be written only when no region it shares a slot with is still in use,
    i.e. every such region's token (the event recorded after the launch that read it) is
    done.  ``take(n, done)`` forgets the regions whose token is done, then returns the
    buffer offset of the next region, or None when a region it would overlap is still in
    use (the caller then uploads another way: it never waits); ``hold(token)`` records
    the token of the region just taken."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("StagingRegions: capacity must be >= 1")
        self.capacity = capacity
        self.pos = 0  # buffer offset of the next region
        self.live: list[tuple[int, int, Any]] = []  # (start, end, token), in use or unknown
        self._taken: tuple[int, int] | None = None

    def take(self, n: int, done: Callable[[Any], bool]) -> int | None:
        if n < 1 or n > self.capacity:
            return None
        off = self.pos if self.pos + n <= self.capacity else 0
        self.live = [r for r in self.live if not done(r[2])]
        if any(a < off + n and off < b for a, b, _ in self.live):
            return None
        self._taken = (off, off + n)
        self.pos = off + n
        return off

    def hold(self, token: Any) -> None:
        assert self._taken is not None, "hold() without take()"
        self.live.append((*self._taken, token))
        self._taken = None


class IdUpload:
    """int64 block ids -> a device tensor for the copy kernels, without a host allocation
    per call: the ids are written into a persistent pinned buffer and copied
    asynchronously into the same offsets of a persistent device buffer, on the current
    stream.  ``__call__`` returns (device ids, staged); when ``staged``, the caller calls
    ``consumed()`` on the same stream right after the launch that reads them (one event:
    the region is rewritten only after it completed; ``StagingRegions``).  When the
    region is still in use, on a CPU device, or with ``staged=False`` (every call then
    takes that path), it falls back to ``_device_ids``."""

    def __init__(self, device: torch.device, capacity: int = 1 << 15, staged: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and staged
        self.regions = StagingRegions(capacity)
        self.staged = self.fallbacks = 0
        if self.cuda:
            self.pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self.host = self.pinned.numpy()
            self.buf = torch.empty(capacity, dtype=torch.int64, device=self.device)

    def __call__(self, ids: np.ndarray) -> tuple[torch.Tensor, bool]:
        n = len(ids)
        off = self.regions.take(n, _event_done) if self.cuda else None
        if off is None:
            self.fallbacks += self.cuda
            return _device_ids(ids, self.device), False
        self.host[off:off + n] = ids
        dev = self.buf[off:off + n]
        dev.copy_(self.pinned[off:off + n], non_blocking=True)
        self.staged += 1
        return dev, True

    def consumed(self) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.regions.hold(ev)


def _event_done(ev: Any) -> bool:
    return ev.query()


class PageGather:
    """``gather(ring, start, group, gpu_ids)``: copy every tensor page of KV group
    ``group`` of GPU blocks ``gpu_ids`` into ring rows ``start ..`` on the current CUDA
    stream, in one launch.  ``launch_on(stream, start, group, gpu_ids)``: the same onto
    ``stream`` through the lean path (``raw_issue``: the kernel compiled by ``warm_up``,
    ids through ``raw_ids``, an ``IdStage``); it needs ``warm_up()`` first."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 ring: torch.Tensor, staged_ids: bool = True, raw_ids: Any = None):
        if triton is None:
            raise RuntimeError("PageGather needs Triton")
        self.ring_ptr = ring.data_ptr()
        self.device = ring.device
        self.tables, self.max_bytes = _page_tables(tensors, group_refs, placement, ring,
                                                   "PageGather", self.device)
        self.tab_ptrs = [t.data_ptr() for t in self.tables]
        self.chunks = [-(-b // CHUNK_BYTES) for b in self.max_bytes]
        self.upload = IdUpload(self.device, staged=staged_ids)
        self.raw_ids = raw_ids
        self.compiled: dict[int, Any] = {}

    def __call__(self, ring: torch.Tensor, start: int, group: int,
                 gpu_ids: np.ndarray) -> None:
        n = len(gpu_ids)
        tab = self.tables[group]
        if n == 0 or tab.shape[0] == 0:
            return
        assert ring.data_ptr() == self.ring_ptr, "PageGather was built for another ring"
        ids, staged = self.upload(gpu_ids)
        _gather_pages_kernel[(n, tab.shape[0], self.chunks[group])](
            ids, tab, self.ring_ptr, start, CHUNK=CHUNK_BYTES, num_warps=4)
        if staged:
            self.upload.consumed()

    def warm_up(self) -> None:
        """Compile the kernel of every KV group now (a launch that copies GPU block 0 into
        ring row 0, which no store holds yet), then keep each compiled kernel for
        ``launch_on``."""
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        for g, tab in enumerate(self.tables):
            if tab.shape[0] == 0:
                continue
            k = _gather_pages_kernel[(1, tab.shape[0], self.chunks[g])](
                ids, tab, self.ring_ptr, 0, CHUNK=CHUNK_BYTES, num_warps=4)
            launch = _compiled_launch(k, "ring gather")
            if launch is not None:
                self.compiled[g] = launch

    def raw_ready(self) -> bool:
        """Whether ``launch_on`` can launch every KV group with pages (``warm_up`` kept a
        compiled launcher for each)."""
        return all(g in self.compiled for g, t in enumerate(self.tables) if t.shape[0])

    def launch_on(self, stream: Any, start: int, group: int, gpu_ids: Any) -> None:
        n = len(gpu_ids)
        ntab = self.tables[group].shape[0]
        if n == 0 or ntab == 0:
            return
        ids = self.raw_ids.put(gpu_ids, stream)
        self.compiled[group]((n, ntab, self.chunks[group]), stream.cuda_stream, ids,
                             self.tab_ptrs[group], self.ring_ptr, start, CHUNK_BYTES)
        ev = torch.cuda.Event()
        ev.record(stream)
        self.raw_ids.hold(ev)


class HostPageCopy:
    """``to_gpu(host, group, host_ids, gpu_ids)`` / ``to_host(host, group, gpu_ids,
    host_ids)``: copy every tensor page of KV group ``group`` between GPU blocks and
    rows of the pinned host buffer ``host``, on the current CUDA stream, by ``programs``
    persistent Triton programs that address the host buffer directly (no copy engine;
    see the module docstring).  Same signatures as the copiers' (``worker.py``).
    ``launch_on(stream, group, host_ids, gpu_ids, to_gpu)``: the same onto ``stream``
    through the lean path (``raw_issue``; ids through ``raw_ids``), after ``warm_up()``."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 host: torch.Tensor, device: torch.device, programs: int = HOST_PROGRAMS,
                 staged_ids: bool = True, raw_ids: Any = None):
        if triton is None:
            raise RuntimeError("HostPageCopy needs Triton")
        if programs < 1:
            raise ValueError("HostPageCopy: programs must be >= 1")
        self.host_ptr = host.data_ptr()
        self.device = torch.device(device)
        self.programs = programs
        self.tables, widest = _page_tables(tensors, group_refs, placement, host,
                                           "HostPageCopy", self.device)
        self.tab_ptrs = [t.data_ptr() for t in self.tables]
        self.nchunks = [-(-w // CHUNK_BYTES) for w in widest]
        self.upload = IdUpload(self.device, staged=staged_ids)
        self.raw_ids = raw_ids
        self.compiled: dict[tuple[int, bool], Any] = {}

    def _launch(self, host: torch.Tensor, group: int, gpu_ids: np.ndarray,
                host_ids: np.ndarray, to_gpu: bool) -> None:
        n = len(gpu_ids)
        assert n == len(host_ids)
        tab = self.tables[group]
        if n == 0 or tab.shape[0] == 0:
            return
        assert host.data_ptr() == self.host_ptr, "HostPageCopy was built for another buffer"
        ids, staged = self.upload(np.concatenate([gpu_ids, host_ids]))
        _host_pages_kernel[(self.programs,)](
            ids, n, tab, tab.shape[0], self.nchunks[group], self.host_ptr,
            TO_GPU=to_gpu, CHUNK=CHUNK_BYTES, num_warps=4)
        if staged:
            self.upload.consumed()

    def to_gpu(self, host: torch.Tensor, group: int, host_ids: np.ndarray,
               gpu_ids: np.ndarray) -> None:
        self._launch(host, group, gpu_ids, host_ids, True)

    def to_host(self, host: torch.Tensor, group: int, gpu_ids: np.ndarray,
                host_ids: np.ndarray) -> None:
        self._launch(host, group, gpu_ids, host_ids, False)

    def launch_on(self, stream: Any, group: int, host_ids: Any, gpu_ids: Any,
                  to_gpu: bool = True) -> None:
        n = len(gpu_ids)
        assert n == len(host_ids)
        ntab = self.tables[group].shape[0]
        if n == 0 or ntab == 0:
            return
        ids = self.raw_ids.put(np.concatenate([gpu_ids, host_ids]), stream)
        self.compiled[(group, to_gpu)](
            (self.programs, 1, 1), stream.cuda_stream, ids, n, self.tab_ptrs[group], ntab,
            self.nchunks[group], self.host_ptr, to_gpu, CHUNK_BYTES)
        ev = torch.cuda.Event()
        ev.record(stream)
        self.raw_ids.hold(ev)

    def warm_up(self) -> None:
        """Compile both directions now (launches of no items: they copy nothing), not
        inside the first forward step that loads, and keep each compiled kernel for
        ``launch_on``."""
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        for g, tab in enumerate(self.tables):
            if tab.shape[0] == 0:
                continue
            for to_gpu in (True, False):
                k = _host_pages_kernel[(self.programs,)](
                    ids, 0, tab, tab.shape[0], self.nchunks[g], self.host_ptr,
                    TO_GPU=to_gpu, CHUNK=CHUNK_BYTES, num_warps=4)
                launch = _compiled_launch(k, "host page copy")
                if launch is not None:
                    self.compiled[(g, to_gpu)] = launch

    def raw_ready(self) -> bool:
        """Whether ``launch_on`` can launch every KV group with pages, both ways."""
        return all((g, d) in self.compiled for g, t in enumerate(self.tables) if t.shape[0]
                   for d in (True, False))
