"""KV block layouts and the copies between GPU blocks, ring slots and host rows.

vLLM hands the spec ``CanonicalKVCaches``: tensors whose first dimension is
``num_blocks``, viewed as int8 rows of ``page_size_bytes`` (ION ``[num_blocks, 2, Hkv, P,
D]``, FLASH_ATTN ``[num_blocks, Hkv, P, 2*D]``).  A host row (and a ring slot) holds one block: every canonical tensor's
page, concatenated (``slot_bytes`` = vLLM's ``worker_kv_bytes_per_block``).
"""

from __future__ import annotations

import numpy as np
import torch

#: ``runs`` walks sequences of up to this many positions in Python, longer ones with numpy
#: (on the CPU a Python walk of 1-4 positions took 0.3-0.6 us against numpy's ~8 us)
RUNS_PY_MAX = 64


def runs(a, b) -> list[tuple[int, int, int, int]]:
    """Positions of ``a`` and ``b`` (equal-length int sequences) split into maximal runs
    where both step by +1: (i0, i1, a[i0], b[i0]) for positions [i0, i1)."""
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


def group_runs(groups: np.ndarray, a: int, b: int):
    """Yield (group, i0, i1) for maximal same-group runs of positions [a, b)."""
    i = a
    while i < b:
        g = int(groups[i])
        j = i + 1
        while j < b and groups[j] == g:
            j += 1
        yield g, i, j
        i = j


class TorchCopier:
    """Block copies with plain torch ops; any device (the CPU tests, and the CUDA path
    where vLLM's batched copy is missing).  The host pool and the ring are
    ``[rows, slot_bytes]`` int8 buffers; tensor ``t``'s page of row ``r`` sits at byte
    ``offsets[t]`` of the row (``placement``)."""

    name = "torch"

    def __init__(self, tensors: list[torch.Tensor], offsets: list[int],
                 group_refs: list[list[tuple[int, int]]]):
        self.tensors = tensors
        self.offsets = offsets
        self.group_refs = group_refs

    def placement(self, buf: torch.Tensor, t: int) -> tuple[int, int]:
        """(byte offset of row 0, row stride in bytes) of tensor ``t``'s pages in a
        host/ring buffer."""
        return self.offsets[t], buf.stride(0)

    def view(self, buf: torch.Tensor, t: int, nb: int) -> torch.Tensor:
        """``[rows, nb]`` view of tensor ``t``'s pages in a host/ring buffer."""
        return buf[:, self.offsets[t]:self.offsets[t] + nb]

    def gather(self, ring: torch.Tensor, start: int, group: int,
               gpu_ids: np.ndarray) -> None:
        n = len(gpu_ids)
        for t, nb in self.group_refs[group]:
            src = self.tensors[t]
            idx = torch.from_numpy(gpu_ids).to(src.device)
            self.view(ring, t, nb)[start:start + n].copy_(src.index_select(0, idx)[:, :nb])

    def drain(self, ring: torch.Tensor, start: int, host: torch.Tensor,
              host_ids: np.ndarray) -> None:
        """Ring rows ``start ..`` -> host rows ``host_ids``: one copy per run of
        consecutive host rows (whole slots)."""
        slots = np.arange(start, start + len(host_ids))
        for i0, i1, s0, h0 in runs(slots, host_ids):
            n = i1 - i0
            host[h0:h0 + n].copy_(ring[s0:s0 + n], non_blocking=True)

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
    """CUDA: all block x tensor copies of one GPU <-> host call in one driver call
    (vLLM's swap_blocks_batch -> cuMemcpyBatchAsync).  Where a tensor's rows are
    contiguous on both sides (GPU row stride == host row stride == page bytes: a single
    cross-layer KV tensor), a run of consecutive blocks is one descriptor.  The drain
    (ring -> host) stays ``TorchCopier``'s: one copy per run of whole slots."""

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


def batch_copier_available() -> bool:
    """Whether vLLM's CUDA ops carry ``swap_blocks_batch`` (BatchCopier)."""
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception:  # pragma: no cover - missing vLLM CUDA ops
        return False
    return hasattr(torch.ops, "_C_cache_ops") and hasattr(torch.ops._C_cache_ops,
                                                          "swap_blocks_batch")
