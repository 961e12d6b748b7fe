"""The KV tier's host pool: exactly ``rows x row_bytes`` of page-locked host memory.

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
rounds every request up to a power of two: a 40 GiB pool would lock 64 GiB.  The pool is
instead one anonymous mapping of the exact size (page-aligned, committed as it is
written), page-locked with ``cudaHostRegister``.  If locking fails (memlock limit, not
enough free RAM), the pool stays pageable: the tier still works, its copies are staged by
the driver and slower, and a warning says so.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def _cuda_register(ptr: int, nbytes: int) -> str | None:
    """Page-lock ``nbytes`` at ``ptr``; None on success, else the CUDA error string."""
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(ptr, nbytes, 0)
    if int(err) == 0:
        return None
    return rt.cudaGetErrorString(err) if hasattr(rt, "cudaGetErrorString") else str(err)


def _cuda_unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostPool:
    """``HostPool(rows, row_bytes, pin)``: ``tensor`` is an int8 ``[rows, row_bytes]``
    host tensor; ``pinned`` says whether it is page-locked.  ``register`` /
    ``unregister`` default to CUDA's (tests pass their own)."""

    def __init__(self, rows: int, row_bytes: int, pin: bool,
                 register: Callable[[int, int], str | None] | None = None,
                 unregister: Callable[[int], None] | None = None):
        self.nbytes = rows * row_bytes
        self._map: mmap.mmap | None = mmap.mmap(-1, max(1, self.nbytes))
        flat = torch.frombuffer(self._map, dtype=torch.int8, count=self.nbytes) \
            if self.nbytes else torch.empty(0, dtype=torch.int8)
        self.tensor = flat.view(rows, row_bytes)
        self._unregister = unregister or _cuda_unregister
        self.pinned = False
        if pin and self.nbytes:
            err = (register or _cuda_register)(self.tensor.data_ptr(), self.nbytes)
            self.pinned = err is None
            if err is not None:
                logger.warning("Ion KV tier: could not page-lock the %.2f GiB host pool "
                               "(%s); it stays pageable: restores and stores work but are "
                               "slower. Lower cpu_bytes_to_use / --kv-offloading-size, or "
                               "raise the memlock limit (ulimit -l)", self.nbytes / 2**30,
                               err)

    def close(self) -> None:
        """Unlock the pool (its tensor stays readable until the last reference goes)."""
        if self.pinned:
            self._unregister(self.tensor.data_ptr())
            self.pinned = False

    def __del__(self) -> Any:
        try:
            self.close()
        except Exception:  # interpreter shutdown: CUDA may be gone already
            pass
