"""The GPU -> ring gather of a store on the SMs: one Triton launch on vLLM's compute stream.

Not on the copy engines: on the H200 a batch of one-page device-to-device descriptors
(vLLM's ``swap_blocks_batch``) moved about 7 GB/s, slower than the PCIe drain behind it; on
the SMs a 3.5 MiB block costs microseconds.  Tensor ``t``'s page of GPU block ``b`` is at
``base[t] + b * stride[t]``, and ring row ``r`` holds it at ``ring + roff[t] + r *
rstride[t]`` (``TorchCopier.placement``); the per-tensor table is uploaded once per KV
group, and only the block ids travel per call (a pinned tensor and an async copy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

try:  # Triton ships with vLLM; absent only in unusual CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

CHUNK_BYTES = 16384  # bytes one program copies; pages are split into chunks of this
ALIGN = 16  # every address and page size must be a multiple (checked on the host)


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


def available() -> bool:
    return triton is not None


def _page_tables(tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 buf: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Per KV group, the table (int64 ``[tensors, 5]`` on ``buf``'s device) of rows (GPU
    base, GPU row stride, buffer offset, buffer row stride, bytes) of its tensors' pages in
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
                raise ValueError(f"PageGather: tensor {t} is not {ALIGN}-byte aligned "
                                 f"(base, stride, buffer offset, buffer stride, bytes = {row})")
            rows.append(row)
        tables.append(torch.tensor(rows, dtype=torch.int64, device=buf.device).reshape(-1, 5))
        widest.append(max((nb for _, nb in refs), default=0))
    return tables, widest


def device_ids(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 ids as a tensor on ``device``; on CUDA through PyTorch's pinned caching host
    allocator and an async copy, so the host never waits on a stream."""
    t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class PageGather:
    """``gather(ring, start, group, gpu_ids)``: copy every tensor page of KV group
    ``group`` of GPU blocks ``gpu_ids`` into ring rows ``start ..`` on the current CUDA
    stream, in one launch (the copiers' ``gather`` signature, worker.py)."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 ring: torch.Tensor):
        if triton is None:
            raise RuntimeError("PageGather needs Triton")
        self.ring_ptr = ring.data_ptr()
        self.device = ring.device
        self.tables, widest = _page_tables(tensors, group_refs, placement, ring)
        self.chunks = [-(-b // CHUNK_BYTES) for b in widest]

    def _launch(self, ids: torch.Tensor, n: int, start: int, group: int) -> None:
        tab = self.tables[group]
        _gather_pages_kernel[(n, tab.shape[0], self.chunks[group])](
            ids, tab, self.ring_ptr, start, CHUNK=CHUNK_BYTES, num_warps=4)

    def __call__(self, ring: torch.Tensor, start: int, group: int,
                 gpu_ids: np.ndarray) -> None:
        n = len(gpu_ids)
        if n == 0 or self.tables[group].shape[0] == 0:
            return
        assert ring.data_ptr() == self.ring_ptr, "PageGather was built for another ring"
        self._launch(device_ids(gpu_ids, self.device), n, start, group)

    def warm_up(self) -> None:
        """Compile the kernel of every KV group now, not inside the first forward step
        that stores (a launch that copies GPU block 0 into ring row 0, which no store
        holds yet)."""
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        for g, tab in enumerate(self.tables):
            if tab.shape[0]:
                self._launch(ids, 1, 0, g)
