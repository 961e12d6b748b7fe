"""Bounded HBM staging ring for eager KV writeback.

The ring is one device buffer of ``num_slots x slot_bytes`` (one slot = one KV block of
every layer of this worker), at most ``ring_bytes`` in total.  Slots are handed out FIFO
as contiguous runs and given back FIFO, in the order the drain stream completes them (a
single stream finishes its work in order).

A store gathers GPU KV blocks into ring slots (device to device, fast); from then on the
source blocks may be reused.  The drain stream then copies the slots to the pinned host
pool and the slots are released.  When no slot is free the worker does not wait: the rest
of the job is copied GPU -> host directly (worker.py, "spill").  ``ring_bytes == 0`` is a
ring of no slots: every block takes that direct path.
"""

from __future__ import annotations

from collections import deque

import torch


class RingAllocator:
    """FIFO allocator of contiguous slot runs over ``num_slots`` slots (0: a ring
    that never has room)."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError("staging ring slot count must be >= 0")
        self.num_slots = num_slots
        self.head = 0  # next slot to hand out
        self.used = 0
        self._runs: deque[tuple[int, int]] = deque()  # (start, count), oldest first
        self.peak = 0

    @property
    def free(self) -> int:
        return self.num_slots - self.used

    def alloc(self, n: int) -> tuple[int, int] | None:
        """Give up to n slots as one contiguous run (may be fewer when the run
        would wrap around the end of the buffer).  None when the ring is full."""
        if n <= 0 or self.free == 0:
            return None
        tail_room = self.num_slots - self.head
        count = min(n, self.free, tail_room)
        start = self.head
        self.head = (self.head + count) % self.num_slots
        self.used += count
        self.peak = max(self.peak, self.used)
        self._runs.append((start, count))
        assert self.used <= self.num_slots
        return start, count

    def release_oldest(self, start: int, count: int) -> None:
        """Release the oldest outstanding run (must be (start, count))."""
        assert self._runs and self._runs[0] == (start, count), "out-of-order release"
        self._runs.popleft()
        self.used -= count
        assert self.used >= 0

    def check(self) -> None:
        assert 0 <= self.used <= self.num_slots
        assert sum(c for _, c in self._runs) == self.used
        if self._runs:
            # runs are contiguous in FIFO order modulo wrap
            s0, _ = self._runs[0]
            pos = s0
            for s, c in self._runs:
                assert s == pos % self.num_slots, "ring runs not contiguous"
                pos = s + c
            assert pos % self.num_slots == self.head


class StagingRing:
    """The device buffer plus its allocator."""

    def __init__(self, ring_bytes: int, slot_bytes: int, device: torch.device):
        if slot_bytes <= 0:
            raise ValueError("slot_bytes must be positive")
        num_slots = ring_bytes // slot_bytes
        if num_slots < 1 and ring_bytes != 0:
            raise ValueError(
                f"staging ring of {ring_bytes} bytes cannot hold one KV block "
                f"({slot_bytes} bytes); raise ring_mib (or set 0: no ring)"
            )
        self.slot_bytes = slot_bytes
        self.alloc = RingAllocator(num_slots)
        self.buffer = torch.empty((num_slots, slot_bytes), dtype=torch.int8, device=device)
        assert self.buffer.numel() <= ring_bytes

    @property
    def num_slots(self) -> int:
        return self.alloc.num_slots

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()
