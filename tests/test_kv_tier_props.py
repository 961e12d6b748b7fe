"""Randomized property tests of the Ion KV tier (manager + worker + ring) on CPU."""

import random

import pytest
import torch

from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.staging_ring import RingAllocator
from ion_vllm.kv_tier.testing import Corruption, run_random_ops
from ion_vllm.kv_tier.worker import BatchCopier, IonKVTierWorker, TorchCopier


@pytest.mark.parametrize("completion", ["read", "host"])
@pytest.mark.parametrize("overflow", ["direct", "defer"])
@pytest.mark.parametrize("layout,seed", [("ion", 11), ("kv_first", 12)])
def test_random_ops_10k(layout, seed, overflow, completion):
    r = run_random_ops(seed, 10_000, layout=layout, overflow=overflow, completion=completion)
    assert sum(r.ops.values()) == 10_000
    # the run really exercised every path
    assert r.restored_blocks > 200 and r.verified_blocks > 0
    assert r.evicted_blocks > 0 and r.dropped_blocks > 0
    ws = r.worker_stats
    if overflow == "defer":  # ring full: blocks wait for slots, flushes bypass the ring
        assert ws["deferred_blocks"] > 0 and ws["bypass_blocks"] > 0
        assert ws["spill_blocks"] == 0
    else:  # ring full: the rest goes GPU -> host at once; nothing waits, nothing bypasses
        assert ws["spill_blocks"] > 0 and ws["d2d_blocks"] > 0
        assert ws["deferred_blocks"] == 0 and ws["bypass_blocks"] == 0
    assert ws["ring_peak_slots"] == ws["ring_slots"]
    if completion == "read":  # loads really met drains still running, and waited for them
        assert ws["loads_ordered_after_drain"] > 0


@pytest.mark.parametrize("overflow", ["direct", "defer"])
def test_random_ops_10k_tensor_host_layout(overflow):
    """host_layout="tensor": one host (and ring) region per KV tensor."""
    r = run_random_ops(14, 10_000, overflow=overflow, host_layout="tensor")
    assert r.restored_blocks > 200 and r.evicted_blocks > 0 and r.dropped_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0


def _memmove_swap(src, dst, sizes, is_src_access_order_any=False):
    """swap_blocks_batch on the CPU: copy each descriptor's bytes between real addresses."""
    import ctypes

    for a, b, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(b, a, n)


class _MemmoveBatchWorker(IonKVTierWorker):
    """The CUDA copier's address arithmetic (BatchCopier), executed with memmove."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        assert isinstance(self.copier, BatchCopier)
        self.copier._swap = _memmove_swap
        self.descriptor_sizes = []
        swap = self.copier._swap

        def counting(src, dst, sizes, is_src_access_order_any=False):
            self.descriptor_sizes += sizes.tolist()
            swap(src, dst, sizes, is_src_access_order_any)

        self.copier._swap = counting


@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_batch_copier_addresses(layout, host_layout):
    """Every descriptor the CUDA path would hand cuMemcpyBatchAsync moves the right bytes:
    3,000 random operations with the copies done by memmove at those addresses."""
    made = []

    class W(_MemmoveBatchWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    r = run_random_ops(31, 3000, layout=layout, copier="batch", worker_cls=W,
                       host_layout=host_layout)
    assert r.restored_blocks > 100
    sizes = set(made[0].descriptor_sizes)
    pages = set(made[0].page_bytes)
    if host_layout == "slot":  # one descriptor per block and tensor
        assert sizes == pages
    else:  # runs of consecutive blocks went as one descriptor
        assert any(z > max(pages) for z in sizes)
        assert all(any(z % p == 0 for p in pages) for z in sizes)


@pytest.mark.parametrize("overflow", ["direct", "defer"])
def test_random_ops_10k_issued_at_submit(overflow):
    """issue_at="submit" (GPU work issued inside the submit calls, the A/B path): nothing
    lost either, and loads still met running drains and waited for them."""
    r = run_random_ops(21, 10_000, overflow=overflow, issue_at="submit")
    assert r.restored_blocks > 200 and r.evicted_blocks > 0
    assert r.worker_stats["loads_ordered_after_drain"] > 0


def test_random_ops_10k_without_ring():
    """ring 0 MiB: every block goes GPU -> host directly; nothing is lost either."""
    r = run_random_ops(13, 10_000, ring_slots=0)
    ws = r.worker_stats
    assert r.restored_blocks > 200 and r.evicted_blocks > 0
    assert ws["ring_slots"] == 0 and ws["d2d_blocks"] == 0
    assert ws["spill_blocks"] == r.stored_blocks > 0


def test_ring_without_slots_refuses_defer():
    with pytest.raises(ValueError, match="no slots"):
        run_random_ops(1, 10, ring_slots=0, overflow="defer")


@pytest.mark.parametrize("seed", range(6))
def test_random_ops_configs(seed):
    rng = random.Random(seed)
    ring_slots = rng.randint(0, 12)
    run_random_ops(100 + seed, 1500, layout=rng.choice(["ion", "kv_first"]),
                   num_gpu_blocks=rng.randint(12, 64), num_host_blocks=rng.randint(4, 80),
                   ring_slots=ring_slots, window=rng.randint(1, 40),
                   overflow=rng.choice(["direct", "defer"]) if ring_slots else "direct",
                   completion=rng.choice(["read", "host"]),
                   host_layout=rng.choice(["slot", "tensor"]),
                   issue_at=rng.choice(["finish", "submit"]),
                   issue_api=rng.choice(["raw", "torch"]))


def test_eager_runtime_never_defers_forever():
    r = run_random_ops(7, 1500, runtime=SimRuntime(eager=True))
    assert r.restored_blocks > 0


# ---- the harness must catch broken implementations -------------------------
class _CorruptCopier(TorchCopier):
    def drain(self, ring, start, host, host_ids):
        super().drain(ring, start, host, host_ids)
        host[int(host_ids[0]), 5] ^= 0x10


class _CorruptWorker(IonKVTierWorker):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.copier = _CorruptCopier(self.tensors, self.offsets, self.copier.group_refs)


class _NoFlushWorker(IonKVTierWorker):
    def wait(self, job_ids):  # returns before the GPU blocks were read
        return


class _LoadIgnoresDrainWorker(IonKVTierWorker):
    """Reports stores at read (the default) but loads without waiting for drains."""

    def _issue_load(self, *args):  # where a load's GPU work is issued (either issue_at)
        pending, self._host_pending = self._host_pending, {}
        try:
            return super()._issue_load(*args)
        finally:
            self._host_pending = pending


class _WriteOverPendingDrainWorker(IonKVTierWorker):
    """Writes a host block without waiting for an older, still-running drain into it
    (loads still wait)."""

    def _after_pending_writes(self, stream, host_ids):
        if stream is self._load:
            return super()._after_pending_writes(stream, host_ids)
        return False


class _UnorderedSim(SimRuntime):
    def wait_event(self, stream, event):  # drain no longer waits for its D2D copy
        return


class _NoTouchManager(IonKVTierManager):
    def touch(self, keys, req_context):
        return


class _MRUManager(IonKVTierManager):
    def prepare_store(self, keys, req_context):
        self._lru = type(self._lru)(reversed(self._lru.items()))  # evicts MRU first
        out = super().prepare_store(keys, req_context)
        self._lru = type(self._lru)(reversed(self._lru.items()))
        return out


def test_detects_corrupted_copy():
    """(the torch copier's drain; the raw path's pointer drain has its own mutant in
    test_kv_tier_raw_issue.py)"""
    with pytest.raises(Corruption):
        run_random_ops(3, 3000, worker_cls=_CorruptWorker, issue_api="torch")


def test_detects_missing_flush():
    with pytest.raises(Corruption):
        run_random_ops(4, 3000, worker_cls=_NoFlushWorker)


@pytest.mark.parametrize("issue_at,seed", [("finish", 3), ("submit", 9)])
def test_detects_load_that_overtakes_a_drain(issue_at, seed):
    """completion="read" is only safe because loads wait for pending drains, whether a
    load is issued at its submit call or at the next get_finished."""
    with pytest.raises(Corruption):
        run_random_ops(seed, 3000, worker_cls=_LoadIgnoresDrainWorker, issue_at=issue_at)


@pytest.mark.parametrize("issue_at,seed", [("finish", 23), ("submit", 22)])
def test_detects_write_over_a_pending_drain(issue_at, seed):
    """Under completion="read" a host block can be evicted and written again (here by a
    flush's bypass copy on another stream: the gather's own, gather_stream="own"; with the
    default gather on the compute stream, bypasses queue on the drain stream itself)
    while its old drain still runs."""
    own = {"gather_stream": "own"}
    with pytest.raises(Corruption):
        run_random_ops(seed, 3000, worker_cls=_WriteOverPendingDrainWorker, overflow="defer",
                       num_host_blocks=16, issue_at=issue_at, worker_kw=own)
    for s in (seed, seed + 2, seed + 3):  # the same runs with the real worker
        for kw in (own, None):
            run_random_ops(s, 3000, overflow="defer", num_host_blocks=16, issue_at=issue_at,
                           worker_kw=kw)


def test_detects_unordered_drain():
    with pytest.raises(Corruption):
        run_random_ops(5, 3000, runtime=_UnorderedSim())


@pytest.mark.parametrize("cls", [_NoTouchManager, _MRUManager])
def test_detects_lru_violation(cls):
    with pytest.raises(AssertionError, match="LRU|evicted"):
        run_random_ops(6, 3000, manager_cls=cls)


# ---- ring allocator ---------------------------------------------------------
def test_ring_allocator_random():
    rng = random.Random(0)
    for n in (1, 2, 7, 64):
        a = RingAllocator(n)
        live = []
        for _ in range(5000):
            if rng.random() < 0.55:
                r = a.alloc(rng.randint(1, n + 3))
                if r is None:
                    assert a.free == 0
                else:
                    assert 1 <= r[1] and r[0] + r[1] <= n
                    live.append(r)
            elif live:
                a.release_oldest(*live.pop(0))
            assert a.used == sum(c for _, c in live) <= n
            a.check()
        assert a.peak == n


def test_ring_release_out_of_order_rejected():
    a = RingAllocator(8)
    a.alloc(3)
    r2 = a.alloc(3)
    with pytest.raises(AssertionError):
        a.release_oldest(*r2)


def test_manager_byte_budget_enforced():
    with pytest.raises(ValueError):
        IonKVTierManager(10, 100, 999, 4)


def test_canonicalize_kv_first_splits_k_and_v():
    from ion_vllm.kv_tier.worker import canonicalize_layer_caches

    t = torch.arange(2 * 5 * 4 * 2 * 8, dtype=torch.float16).view(2, 5, 4, 2, 8)
    c = canonicalize_layer_caches([t], 5)
    assert len(c.tensors) == 2
    k, v = c.tensors[0].tensor, c.tensors[1].tensor
    assert k.shape == (5, 4 * 2 * 8 * 2) and v.shape == k.shape
    assert torch.equal(k[3].view(torch.float16), t[0, 3].flatten())
    assert torch.equal(v[1].view(torch.float16), t[1, 1].flatten())
    ion = torch.randn(5, 2, 2, 4, 8).to(torch.bfloat16)
    c2 = canonicalize_layer_caches({"a": ion, "b": ion}, 5)  # shared storage kept once
    assert len(c2.tensors) == 1
    assert torch.equal(c2.tensors[0].tensor[4].view(torch.bfloat16), ion[4].flatten())
