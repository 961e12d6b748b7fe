"""The KV tier worker's lean issue path (``issue_api="raw"``, the default): fewer host
calls per copy.

Why: a store job's copies are a handful of GPU operations, but issuing them through
PyTorch and Triton's front ends cost 0.3-0.9 ms of host time a job on the H100 (a
``torch.cuda.stream`` context per launch, Triton's JIT dispatcher, a pinned id tensor and
its upload per launch, a ``Tensor.copy_`` per drain run; ``scripts/kv_tier_host_cost.py``).
This path issues the same GPU work with less in between; on the H100 a 4-block
``submit_store`` took 160 us of host time against 458 (twenty-fifth session).  End to end
the saving did not show on that card: the reuse benchmark's engine loop was not
host-bound (2 ms more host time a store job left its wall time unchanged;
``bench/notes.md``).

* ``CompiledLaunch``: a Triton kernel compiled once (at worker start), then launched
  through its compiled launcher onto an explicit stream handle: no specialization key,
  no current-stream lookup, no pointer checks (pointers travel as ints).
* ``IdStage``: the kernels' block ids go through a persistent pinned buffer and a
  persistent device buffer (one raw copy of a region, no allocation or tensor per
  launch).  A region is rewritten only after the event recorded behind the launch that
  read it has completed (``StagingRegions``); when no region is free the ids go into
  fresh tensors that are kept alive until that event completes.
* ``PointerDrain`` with ``CudaMemcpy``: the drain's ring -> host copies as
  ``cudaMemcpyAsync`` calls on an explicit stream (the libcudart PyTorch itself loaded,
  through ctypes), one per run of consecutive host rows, or cut into pieces of a bounded
  size (``drain_chunk_kib``); on a CPU (the tests' simulated streams) ``HostMemmove``
  makes the same calls ``memmove``, so the address arithmetic is checked there byte for
  byte.

The GPU work itself (kernels, copy sizes, stream order, events) is the same as on the
``"torch"`` path, which stays selectable for A/B runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: cudaMemcpyKind: cudaMemcpyDefault (direction from the unified addresses)
_CUDA_MEMCPY_DEFAULT = 4


def _loaded_library(stem: str) -> str | None:
    """Path of the first shared object named ``stem``* mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "/" in path and path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        return None
    return None


def load_cudart() -> ctypes.CDLL:
    """The CUDA runtime library PyTorch uses (the one mapped into this process once CUDA
    is initialized; else by soname).  An OSError when none can be opened."""
    path = _loaded_library("libcudart.so")
    names = [path] if path else []
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        names.append(f"libcudart.so.{major}")
    names.append("libcudart.so")
    err: OSError | None = None
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            err = e
    raise OSError(f"Ion KV tier: cannot open the CUDA runtime ({names}): {err}")


class CudaMemcpy:
    """``copy(dst, src, nbytes, stream)``: ``cudaMemcpyAsync`` of ``nbytes`` between unified
    addresses ``dst`` / ``src`` (ints) on ``stream`` (a ``torch.cuda.Stream``)."""

    def __init__(self):
        lib = load_cudart()
        fn = lib.cudaMemcpyAsync
        fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_void_p)
        fn.restype = ctypes.c_int
        self._fn = fn
        err = lib.cudaGetErrorString
        err.argtypes = (ctypes.c_int,)
        err.restype = ctypes.c_char_p
        self._err = err

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        rc = self._fn(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
        if rc:
            raise RuntimeError(f"Ion KV tier: cudaMemcpyAsync of {nbytes} B failed: "
                               f"{self._err(rc).decode(errors='replace')} ({rc})")


class HostMemmove:
    """CPU stand-in for ``CudaMemcpy`` (host tensors only): the copy happens when the
    simulated stream runs it, so ordering bugs corrupt bytes as they would on CUDA."""

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        ctypes.memmove(dst, src, nbytes)


#: ``runs`` walks sequences of up to this many positions in Python, longer ones with numpy:
#: on the CPU a Python walk of 1-4 positions (a drain's ring run, a decode store) took
#: 0.3-0.6 us against numpy's fixed ~8 us, and numpy wins from ~100 positions with few
#: breaks (1,024 consecutive: 9 against 67 us)
RUNS_PY_MAX = 64


def runs(a, b) -> list[tuple[int, int, int, int]]:
    """Positions of ``a`` and ``b`` (equal-length int sequences) split into maximal runs
    where both step by +1: (i0, i1, a[i0], b[i0]) for positions [i0, i1).  The one split
    of the tier's copies into runs of consecutive rows (the worker's and the drain's)."""
    n = len(a)
    if n <= RUNS_PY_MAX:
        a = a.tolist() if isinstance(a, np.ndarray) else a
        b = b.tolist() if isinstance(b, np.ndarray) else b
        out: list[tuple[int, int, int, int]] = []
        i0 = 0
        for i in range(1, n):
            if a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1:
                out.append((i0, i, int(a[i0]), int(b[i0])))
                i0 = i
        if n:
            out.append((i0, n, int(a[i0]), int(b[i0])))
        return out
    a, b = np.asarray(a), np.asarray(b)
    brk = np.nonzero((np.diff(a) != 1) | (np.diff(b) != 1))[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    return [(int(s), int(e), int(a[s]), int(b[s])) for s, e in zip(starts, ends)]


class PointerDrain:
    """The drain (ring rows -> host rows) as pointer copies: one per run of consecutive
    ring and host rows (per run and KV tensor in the ``tensor`` host layout), issued by
    ``copier.copy`` onto the stream it is handed.  ``placement(buf, t)`` and ``page_bytes``
    are ``TorchCopier``'s (``worker.py``).

    ``chunk_bytes`` > 0 cuts every copy into pieces of at most that many bytes.  Why:
    copies of one direction run in the order they were issued, whatever their stream, so
    a drain of a whole ring run (up to the ring's size, 256 MiB by default) holds every
    GPU -> host copy issued after it, vLLM's per-step copy of the sampled tokens
    included, until it has crossed PCIe (``scripts/copy_contention_probe.py``: a 4 KiB
    copy waited 4.8 ms behind one 256 MiB copy, 1.2 ms behind the same bytes as 1 MiB
    copies).  vLLM's own worker, and Ion's direct copies, move a block as one copy per
    KV tensor page (128 KiB a layer in the ION layout).  ``batch(src, dst, sizes,
    stream)``, when given, issues the pieces in one call (``cuMemcpyBatchAsync`` through
    vLLM's ``swap_blocks_batch``); without it each piece is one ``copier.copy``."""

    def __init__(self, ring: torch.Tensor, host: torch.Tensor, layout: str,
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 page_bytes: list[int], copier: Any, chunk_bytes: int = 0,
                 batch: Callable[[np.ndarray, np.ndarray, np.ndarray, Any], None]
                 | None = None):
        self.ring_ptr, self.host_ptr = ring.data_ptr(), host.data_ptr()
        self.copier = copier
        if chunk_bytes < 0:
            raise ValueError(f"Ion KV tier: drain chunk of {chunk_bytes} B")
        self.chunk_bytes = int(chunk_bytes)
        self.batch = batch
        if layout == "slot":  # whole rows: one region of slot_bytes per row
            self.regions = [(0, 0, ring.stride(0), host.stride(0), ring.stride(0))]
        else:
            self.regions = []
            for t, nb in enumerate(page_bytes):
                r_off, r_stride = placement(ring, t)
                h_off, h_stride = placement(host, t)
                self.regions.append((r_off, h_off, r_stride, h_stride, nb))

    def copies(self, start: int, host_ids: list[int]) -> list[tuple[int, int, int]]:
        """(dst, src, nbytes) of the drain of ring rows ``start``.. into ``host_ids``,
        before chunking."""
        out = []
        for i0, i1, s0, h0 in runs(range(start, start + len(host_ids)), host_ids):
            n = i1 - i0
            for r_off, h_off, r_stride, h_stride, nb in self.regions:
                # a run of rows is contiguous when the row stride is the region's width
                if r_stride == nb and h_stride == nb or n == 1:
                    out.append((self.host_ptr + h_off + h0 * h_stride,
                                self.ring_ptr + r_off + s0 * r_stride, n * nb))
                else:
                    for k in range(n):
                        out.append((self.host_ptr + h_off + (h0 + k) * h_stride,
                                    self.ring_ptr + r_off + (s0 + k) * r_stride, nb))
        return out

    def __call__(self, start: int, host_ids: list[int], stream: Any) -> None:
        copies: Any = self.copies(start, host_ids)
        if self.chunk_bytes:
            dst, src, size = chunked(copies, self.chunk_bytes)
            if self.batch is not None:
                self.batch(src, dst, size, stream)
                return
            copies = zip(dst.tolist(), src.tolist(), size.tolist())
        copy = self.copier.copy
        for d, s, n in copies:
            copy(d, s, n, stream)


def chunked(copies: list[tuple[int, int, int]], chunk: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``copies`` (dst, src, nbytes) cut into pieces of at most ``chunk`` bytes, in order:
    int64 arrays (dst, src, sizes)."""
    c = np.asarray(copies, dtype=np.int64).reshape(-1, 3)
    pieces = (c[:, 2] + chunk - 1) // chunk
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = np.arange(int(pieces.sum()), dtype=np.int64) - first  # piece index in its copy
    row = np.repeat(np.arange(len(c)), pieces)
    off = k * chunk
    size = np.minimum(chunk, c[row, 2] - off)
    return c[row, 0] + off, c[row, 1] + off, size


class CompiledLaunch:
    """A compiled Triton kernel (what ``kernel[grid](...)`` returned at warm-up), launched
    through its compiled launcher onto an explicit stream handle.  ``args``: every
    parameter of the kernel in order, constexprs included (the launcher skips them);
    pointers as ints.  The caller keeps the arguments the kernel was specialized on
    (alignment, value 1) as they were at warm-up: only ``do_not_specialize`` integers and
    16-byte aligned pointers may change."""

    def __init__(self, compiled: Any):
        try:
            from triton import knobs
        except ImportError:  # pragma: no cover - Triton < 3.4
            knobs = None
        self._knobs = knobs
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        self.k = compiled
        self.run = compiled.run  # loads the binary (sets .function) if not yet loaded
        self.function = compiled.function
        self.packed = compiled.packed_metadata

    def __call__(self, grid: tuple[int, int, int], stream: int, *args: Any) -> None:
        k = self.k
        hooks = self._knobs.runtime if self._knobs is not None else None
        enter = hooks.launch_enter_hook if hooks is not None else None
        leave = hooks.launch_exit_hook if hooks is not None else None
        meta = k.launch_metadata(grid, stream, *args) if enter is not None else None
        self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, meta,
                 enter, leave, *args)


class IdStage:
    """int64 block ids for the copy kernels, staged through persistent buffers: ``put(ids,
    stream)`` writes them into a region of a pinned host buffer, copies that region into
    the same offsets of a device buffer on ``stream`` (one ``copier.copy``) and returns the
    device address; ``hold(event)``, right after the launch that reads them (recorded on
    the same stream), keeps both regions from being rewritten until ``event`` has
    completed (``StagingRegions``).  When no region is free the ids go into a fresh pinned
    tensor and device tensor instead, both kept alive until that event completes.  Regions
    start 16-byte aligned (the kernels were compiled for aligned pointers).

    The kernels could read the pinned buffer directly, but the load kernel reads each id
    again in every iteration of its persistent loop, where a PCIe round trip apiece would
    serialize; the one small copy costs one call.  ``mapped=True`` is that direct form, for
    the ring gather (each of its programs reads its one id once): ``put`` writes the ids
    into the pinned buffer and returns their host address, which a kernel reads through
    unified addressing; no copy is queued on ``stream``, and no device buffer is kept."""

    def __init__(self, device: torch.device, copier: Any, capacity: int = 1 << 15,
                 done: Callable[[Any], bool] | None = None, mapped: bool = False):
        from ion_vllm.kv_tier.page_gather import StagingRegions

        self.device = torch.device(device)
        self.copier = copier
        self.regions = StagingRegions(capacity)
        pin = self.device.type == "cuda"
        self.pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=pin)
        self.view = self.pinned.numpy()
        self.mapped = bool(mapped)
        self.buf = None if self.mapped else torch.empty(capacity, dtype=torch.int64,
                                                        device=self.device)
        self.host_base = self.pinned.data_ptr()
        self.dev_base = self.host_base if self.buf is None else self.buf.data_ptr()
        self._done = done or (lambda ev: ev.query())
        self._spare: list[tuple[Any, Any]] = []  # fallback (tensors, event) still in use
        self._pending: Any = None
        self.staged = self.fallbacks = 0

    def put(self, ids: Any, stream: Any) -> int:
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        if self._spare:  # forget fallback tensors whose readers have finished
            self._spare = [(t, ev) for t, ev in self._spare if not self._done(ev)]
        off = self.regions.take(n + (n & 1), self._done)
        if off is not None:
            self.view[off:off + n] = ids
            self._pending = None
            self.staged += 1
            if not self.mapped:
                self.copier.copy(self.dev_base + 8 * off, self.host_base + 8 * off, 8 * n,
                                 stream)
            return self.dev_base + 8 * off
        host = torch.from_numpy(np.array(ids, dtype=np.int64))
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.fallbacks += 1
        if self.mapped:
            self._pending = (host,)
            return host.data_ptr()
        dev = torch.empty(n, dtype=torch.int64, device=self.device)
        self._pending = (host, dev)
        self.copier.copy(dev.data_ptr(), host.data_ptr(), 8 * n, stream)
        return dev.data_ptr()

    def hold(self, event: Any) -> None:
        if self._pending is not None:
            self._spare.append((self._pending, event))
            self._pending = None
        else:
            self.regions.hold(event)
