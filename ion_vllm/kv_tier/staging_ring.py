"""Bounded HBM staging ring for eager KV writeback.

The ring is one device buffer of ``num_slots x slot_bytes`` (one slot = one KV
block of every layer of this worker), at most ``ring_bytes`` in total.  Slots
are handed out FIFO as contiguous runs and given back FIFO, in the order the
drain stream completes them (a single drain stream finishes work in order).

A store copies the GPU KV blocks into ring slots (D2D, fast); from then on the
source blocks may be reused.  The drain stream then copies the slots to the
pinned host pool (D2H) and the slots are released.  When no slot is free the
worker does not wait: with ``overflow="direct"`` (the default) the rest of the
job is copied GPU -> host at once; with ``"defer"`` it waits (counted) for
slots that drains free, and only a flush (``wait``) of a deferred job copies
its leftover blocks straight to the host, bypassing the ring.

``ring_bytes == 0`` is a ring of no slots: every block takes the direct path
(vLLM's native connector's data path, kept selectable for A/B runs); it needs
``overflow="direct"``, since deferred blocks would wait for slots forever.
"""

from __future__ import annotations

from collections import deque

import torch

#: what a store does with the blocks the ring has no room for: copy them GPU -> host at
#: once ("direct", the default) or queue them for ring slots freed later ("defer");
#: see ion_vllm/kv_tier/worker.py
OVERFLOW_POLICIES = ("direct", "defer")

#: when a store job is reported finished to vLLM: once its GPU source blocks have been
#: read ("read", the default; a ring piece's bytes may still be on their way to the host,
#: and every load of those host blocks is ordered after that drain on the device) or once
#: all its bytes are in host memory ("host"); see ion_vllm/kv_tier/worker.py
STORE_COMPLETION = ("read", "host")


#: how the host pool (and the ring) store a block's pages: one slot per block with every
#: tensor's page in it ("slot", the default), or one region per KV tensor ("tensor"); see
#: TorchCopier in ion_vllm/kv_tier/worker.py
HOST_LAYOUTS = ("slot", "tensor")

#: how blocks are copied GPU -> ring: one Triton launch on the SMs ("kernel"), the
#: copier's gather (one copy-engine descriptor per page with the batch copier: "copier"),
#: or the kernel where CUDA and Triton are there ("auto"); see page_gather.py
RING_GATHERS = ("auto", "kernel", "copier")

#: how blocks are copied host -> GPU (loads): by a few persistent Triton programs on the
#: SMs that read the pinned host pool directly ("kernel"), by the copier (copy engines:
#: "copier", the default), or the kernel where CUDA and Triton are there ("auto"); see
#: page_gather.py for why a load on the copy engines can hold up the forward pass's input
#: copies, and worker.py ("One compute stream") for why the copy engines still measured
#: faster end to end
LOAD_COPIES = ("auto", "kernel", "copier")
#: When the worker issues a submitted transfer's GPU work (``worker.py``, "Issue"):
#: ``"submit"`` (default): inside ``submit_store`` / ``submit_load``, before the step's
#: forward pass is enqueued; ``"finish"``: at its next ``get_finished`` / ``wait``, after.
ISSUE_POINTS = ("submit", "finish")
#: How the copy kernels get their block ids onto the GPU (``page_gather.IdUpload``):
#: ``"pin_memory"`` (default): a pinned host tensor from PyTorch's caching host allocator
#: per launch; ``"staged"``: a persistent pinned buffer, no allocation per launch.
ID_UPLOADS = ("pin_memory", "staged")
#: How the worker issues its copies (``raw_issue.py``): ``"raw"`` (default): through
#: explicit stream handles (compiled Triton launchers, ``cudaMemcpyAsync``, persistent id
#: buffers); ``"torch"``: the same GPU work through PyTorch and Triton's front ends (a
#: stream context per launch, Triton's JIT dispatcher, a tensor copy per drain run).
ISSUE_APIS = ("raw", "torch")
#: Test-only host-time probe (``host_delay_us``): where the worker spends the extra host
#: time of each store job: in ``submit_store`` (before the step's forward pass is
#: enqueued) or in the next ``get_finished`` (after it).
HOST_DELAY_POINTS = ("submit", "finish")
#: The stream priority of the GPU -> ring gather (and of flush bypass copies):
#: ``"high"`` (default): above vLLM's compute stream, so the gather's CTAs go first;
#: ``"normal"``: the compute stream's priority.
GATHER_PRIORITIES = ("high", "normal")
#: ``gather_stream``: the GPU -> ring gather on its own stream (at ``gather_priority``), on
#: the drain stream, the stream the direct GPU -> host copies use, or on the compute stream
#: itself, in line with the forward pass (no kernel on any other stream; the default)
GATHER_STREAMS = ("own", "drain", "compute")
#: ``gather_ids``: where the gather kernel reads its block ids: a device buffer the ids are
#: copied into (host -> device, on the gather's stream), or the pinned host buffer itself
GATHER_IDS = ("device", "host")


def _check_choice(value: str, choices: tuple[str, ...], name: str) -> str:
    if value not in choices:
        raise ValueError(f"Ion KV tier: {name} must be one of {choices}, not {value!r}")
    return value


def check_overflow(policy: str, name: str = "overflow") -> str:
    """``policy`` if it is one of OVERFLOW_POLICIES, else a ValueError naming ``name`` (the
    spec's config key or the worker's argument)."""
    return _check_choice(policy, OVERFLOW_POLICIES, name)


def check_store_completion(point: str, name: str = "store_completion") -> str:
    """``point`` if it is one of STORE_COMPLETION, else a ValueError naming ``name``."""
    return _check_choice(point, STORE_COMPLETION, name)


def check_host_layout(layout: str, name: str = "host_layout") -> str:
    """``layout`` if it is one of HOST_LAYOUTS, else a ValueError naming ``name``."""
    return _check_choice(layout, HOST_LAYOUTS, name)


def check_ring_gather(choice: str, name: str = "ring_gather") -> str:
    """``choice`` if it is one of RING_GATHERS, else a ValueError naming ``name``."""
    return _check_choice(choice, RING_GATHERS, name)


def check_load_copy(choice: str, name: str = "load_copy") -> str:
    """``choice`` if it is one of LOAD_COPIES, else a ValueError naming ``name``."""
    return _check_choice(choice, LOAD_COPIES, name)


def check_host_delay(us: float, at: str) -> tuple[float, str]:
    """(``us``, ``at``) of the test-only host-time probe, checked: ``us`` >= 0 and ``at``
    one of HOST_DELAY_POINTS, else a ValueError naming the key."""
    if not us >= 0:
        raise ValueError(f"Ion KV tier: host_delay_us must be >= 0, not {us!r}")
    return float(us), _check_choice(at, HOST_DELAY_POINTS, "host_delay_at")


def check_gather_priority(choice: str, name: str = "gather_priority") -> str:
    """``choice`` if it is one of GATHER_PRIORITIES, else a ValueError naming ``name``."""
    return _check_choice(choice, GATHER_PRIORITIES, name)


def check_gather_stream(choice: str, name: str = "gather_stream") -> str:
    """``choice`` if it is one of GATHER_STREAMS, else a ValueError naming ``name``."""
    return _check_choice(choice, GATHER_STREAMS, name)


def check_gather_ids(choice: str, issue_api: str, name: str = "gather_ids") -> str:
    """``choice`` if it is one of GATHER_IDS, else a ValueError naming ``name``; ``"host"``
    needs ``issue_api="raw"`` (only the raw launch takes an id address)."""
    choice = _check_choice(choice, GATHER_IDS, name)
    if choice == "host" and issue_api != "raw":
        raise ValueError(f"Ion KV tier: {name}='host' needs issue_api='raw' (the torch "
                         f"path uploads ids as tensors), not {issue_api!r}")
    return choice


def check_ring_shape(drain_chunk_kib: float, ring_max_job_blocks: int,
                     issue_api: str) -> tuple[int, int]:
    """(drain chunk in bytes, largest job in blocks the ring takes; 0 = no bound),
    checked: both >= 0, a whole number of blocks, and a drain chunk (the pointer drain's
    option) only with ``issue_api="raw"``; else a ValueError naming the key."""
    if not drain_chunk_kib >= 0:
        raise ValueError(f"Ion KV tier: drain_chunk_kib must be >= 0, not {drain_chunk_kib!r}")
    chunk = int(round(float(drain_chunk_kib) * 1024))
    if drain_chunk_kib and (chunk <= 0 or chunk % 16):
        raise ValueError("Ion KV tier: drain_chunk_kib must be a multiple of 16 bytes, "
                         f"not {drain_chunk_kib!r} KiB")
    if chunk and issue_api != "raw":
        raise ValueError("Ion KV tier: drain_chunk_kib needs issue_api='raw' (the "
                         "pointer drain)")
    if int(ring_max_job_blocks) != ring_max_job_blocks or ring_max_job_blocks < 0:
        raise ValueError("Ion KV tier: ring_max_job_blocks must be a whole number >= 0, "
                         f"not {ring_max_job_blocks!r}")
    return chunk, int(ring_max_job_blocks)


def check_store_batch(blocks: float, steps: float) -> tuple[int, int]:
    """(blocks, steps) of store batching, checked: ``blocks`` a whole number >= 0 (0:
    off), ``steps`` a whole number >= 1; else a ValueError naming the key."""
    for name, v, low in (("store_batch_blocks", blocks, 0), ("store_batch_steps", steps, 1)):
        if int(v) != v or v < low:
            raise ValueError(f"Ion KV tier: {name} must be a whole number >= {low}, "
                             f"not {v!r}")
    return int(blocks), int(steps)


def check_ring_idle(ring_idle: bool, overflow: str, ring_bytes: int) -> bool:
    """The test-only idle-ring probe's flag, checked: it needs ``overflow="direct"`` (a
    ring no store uses would defer blocks forever) and a ring (``ring_bytes`` > 0); else a
    ValueError naming the key."""
    ring_idle = bool(ring_idle)
    if ring_idle and overflow != "direct":
        raise ValueError("Ion KV tier: ring_idle needs ring_overflow='direct' (a ring "
                         "no store uses would defer blocks forever)")
    if ring_idle and ring_bytes == 0:
        raise ValueError("Ion KV tier: ring_idle needs a ring (ring_mib > 0); with "
                         "ring_mib 0 there is nothing to leave idle")
    return ring_idle


def check_id_upload(choice: str, name: str = "id_upload") -> str:
    """``choice`` if it is one of ID_UPLOADS, else a ValueError naming ``name``."""
    return _check_choice(choice, ID_UPLOADS, name)


def check_issue_api(api: str, name: str = "issue_api") -> str:
    """``api`` if it is one of ISSUE_APIS, else a ValueError naming ``name``."""
    return _check_choice(api, ISSUE_APIS, name)


def check_issue_at(point: str, name: str = "issue_at") -> str:
    """``point`` if it is one of ISSUE_POINTS, else a ValueError naming ``name``."""
    return _check_choice(point, ISSUE_POINTS, name)


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

    DEFAULT_BYTES = 256 << 20

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
