"""KV block layouts and the copies between GPU blocks, ring slots and host rows.

vLLM's OffloadingConnector hands the spec ``CanonicalKVCaches``: tensors whose first
dimension is ``num_blocks`` (one per layer, or one for a cross-layer KV cache), viewed as
int8 rows of ``page_size_bytes``.  This holds for the ION layout ``[num_blocks, 2, Hkv, P,
D]`` and for FLASH_ATTN in vLLM 0.26 (``[num_blocks, Hkv, P, 2*D]``).  A layout whose outer
dim is K/V (``[2, num_blocks, P, Hkv, D]``) is split into a K and a V tensor by
``canonicalize_layer_caches``; the worker only ever sees blocks-first rows.

A host row (and a ring slot) holds one block: every canonical tensor's page, concatenated
(``slot_bytes = sum(page_size_bytes)`` = vLLM's ``worker_kv_bytes_per_block``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)

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
