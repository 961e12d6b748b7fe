"""GPU -> ring gather of KV pages with one Triton launch (SM copies, not copy engines).

Why not ``cuMemcpyBatchAsync`` (vLLM's ``swap_blocks_batch``) for this step: on the
H200 a batch of device-to-device descriptors of one page each (128 KiB per layer and
block in the ION layout) moved about 7 GB/s (``scripts/kv_tier_copy_bench.py``, the
ring worker's per-job store rate; see ``bench/notes.md``, seventh session), slower than
the PCIe drain behind it.  A gather on the SMs reads and writes HBM at hundreds of
GB/s, so a 3.5 MiB block costs microseconds of SM time instead of half a millisecond of
a copy engine that the H2D loads also need.

Addressing: tensor ``t`` of the KV cache has its page of GPU block ``b`` at
``base[t] + b * stride[t]``; ring row ``r`` holds it at ``ring + roff[t] + r * rstride[t]``
(``TorchCopier.placement``).  Only the GPU block ids travel per call (int64, through
PyTorch's pinned caching host allocator, so the host never waits on a stream); the
per-tensor table is uploaded once per KV group.
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


class PageGather:
    """``gather(ring, start, group, gpu_ids)``: copy every tensor page of KV group
    ``group`` of GPU blocks ``gpu_ids`` into ring rows ``start ..`` on the current CUDA
    stream, in one launch."""

    def __init__(self, tensors: Sequence[torch.Tensor],
                 group_refs: Sequence[Sequence[tuple[int, int]]],
                 placement: Callable[[torch.Tensor, int], tuple[int, int]],
                 ring: torch.Tensor):
        if triton is None:
            raise RuntimeError("PageGather needs Triton")
        self.ring_ptr = ring.data_ptr()
        self.device = ring.device
        self.tables: list[torch.Tensor] = []
        self.max_bytes: list[int] = []
        for refs in group_refs:
            rows = []
            for t, nb in refs:
                src = tensors[t]
                off, rstride = placement(ring, t)
                row = [src.data_ptr(), src.stride(0), off, rstride, nb]
                if any(int(x) % ALIGN for x in row) or ring.data_ptr() % ALIGN:
                    raise ValueError(f"PageGather: tensor {t} is not {ALIGN}-byte aligned "
                                     f"(base, stride, ring offset, ring stride, bytes = {row})")
                rows.append(row)
            self.tables.append(torch.tensor(rows, dtype=torch.int64, device=self.device))
            self.max_bytes.append(max((nb for _, nb in refs), default=0))

    def __call__(self, ring: torch.Tensor, start: int, group: int,
                 gpu_ids: np.ndarray) -> None:
        n = len(gpu_ids)
        tab = self.tables[group]
        if n == 0 or tab.shape[0] == 0:
            return
        assert ring.data_ptr() == self.ring_ptr, "PageGather was built for another ring"
        ids = torch.from_numpy(np.ascontiguousarray(gpu_ids, dtype=np.int64))
        if self.device.type == "cuda":  # pinned + async: the host never waits on a stream
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        chunks = -(-self.max_bytes[group] // CHUNK_BYTES)
        _gather_pages_kernel[(n, tab.shape[0], chunks)](
            ids, tab, self.ring_ptr, start, CHUNK=CHUNK_BYTES, num_warps=4)
