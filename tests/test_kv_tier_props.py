"""Randomized property tests of the Ion KV tier (manager + worker + ring) on the CPU, on
simulated asynchronous streams run in random interleavings.  Each 10,000-operation run
takes a fresh seed (``fresh_seed``: printed, recorded, named in a failure; replay with
``KV_TIER_SEED=<seed>``); the tests at the end prove the harness catches broken ones."""

import random

import pytest
import torch

from kv_tier_harness import Corruption, fresh_seed, run_random_ops  # noqa: F401 (fixture)

from kv_tier_harness import canonicalize_layer_caches

from ion_vllm.kv_tier.copies import BatchCopier, TorchCopier
from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.staging_ring import RingAllocator
from ion_vllm.kv_tier.worker import IonKVTierWorker


@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_10k(layout, fresh_seed):
    """10,000 random store / flush (preempt) / lookup+load / touch / device-step / poll
    operations: every restored block bit-identical, budget / ring / LRU / counter
    invariants after each, and every path of the default data path taken: the ring (with
    its gather on the compute stream), spills when it is full, loads that had to wait for
    a drain still running into their host blocks (safe only because they wait)."""
    r = run_random_ops(fresh_seed, 10_000, layout=layout)
    assert sum(r.ops.values()) == 10_000
    assert r.restored_blocks > 200 and r.verified_blocks > 0
    assert r.evicted_blocks > 0 and r.dropped_blocks > 0
    ws = r.worker_stats
    assert ws["spill_blocks"] > 0 and ws["d2d_blocks"] > 0
    assert ws["ring_peak_slots"] == ws["ring_slots"]
    assert ws["loads_ordered_after_drain"] > 0


def test_random_ops_10k_without_ring(fresh_seed):
    """ring 0 MiB: every block goes GPU -> host directly; nothing is lost either."""
    r = run_random_ops(fresh_seed, 10_000, ring_slots=0)
    ws = r.worker_stats
    assert r.restored_blocks > 200 and r.evicted_blocks > 0
    assert ws["ring_slots"] == 0 and ws["d2d_blocks"] == 0
    assert ws["spill_blocks"] == r.stored_blocks > 0


@pytest.mark.parametrize("k", range(4))
def test_random_ops_configs(k, fresh_seed):
    """Random shapes: ring size (none included), writeback window, pool sizes, layout."""
    rng = random.Random(fresh_seed + k)
    run_random_ops(fresh_seed + k, 1500, layout=rng.choice(["ion", "kv_first"]),
                   num_gpu_blocks=rng.randint(12, 64), num_host_blocks=rng.randint(4, 80),
                   ring_slots=rng.randint(0, 12), window=rng.randint(1, 40))


def test_eager_runtime(fresh_seed):
    r = run_random_ops(fresh_seed, 1500, runtime=SimRuntime(eager=True))
    assert r.restored_blocks > 0


def _memmove_swap(src, dst, sizes, is_src_access_order_any=False):
    """swap_blocks_batch on the CPU: copy each descriptor's bytes between real addresses."""
    import ctypes

    for a, b, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(b, a, n)


@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_batch_copier_addresses(layout, fresh_seed):
    """Every descriptor the CUDA path hands cuMemcpyBatchAsync moves the right bytes: 3,000
    random operations with the copies done by memmove at those addresses, one descriptor
    per block and tensor."""
    made = []

    class W(IonKVTierWorker):
        @staticmethod
        def _copier_cls(is_cuda):
            return BatchCopier

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.descriptor_sizes = []

            def counting(src, dst, sizes, is_src_access_order_any=False):
                self.descriptor_sizes += sizes.tolist()
                _memmove_swap(src, dst, sizes)

            self.copier._swap = counting
            made.append(self)

    r = run_random_ops(fresh_seed, 3000, layout=layout, worker_cls=W)
    assert r.restored_blocks > 100
    assert set(made[0].descriptor_sizes) == set(made[0].page_bytes)


# ---- the harness must catch broken implementations -------------------------
class _CorruptCopier(TorchCopier):
    def drain(self, ring, start, host, host_ids):
        super().drain(ring, start, host, host_ids)
        host[int(host_ids[0]), 5] ^= 0x10


class _CorruptWorker(IonKVTierWorker):
    @staticmethod
    def _copier_cls(is_cuda):
        return _CorruptCopier


class _NoFlushWorker(IonKVTierWorker):
    def wait(self, job_ids):  # returns before the GPU blocks were read
        return


class _LoadIgnoresDrainWorker(IonKVTierWorker):
    """Reports stores once read but loads without waiting for their drains."""

    def submit_load(self, *args):
        pending, self._host_pending = self._host_pending, {}
        try:
            return super().submit_load(*args)
        finally:
            self._host_pending = pending


class _UnorderedSim(SimRuntime):
    def wait_event(self, stream, event):  # the drain no longer waits for its gather
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


@pytest.mark.parametrize("kw", [
    {"worker_cls": _CorruptWorker},
    {"worker_cls": _NoFlushWorker},
    {"worker_cls": _LoadIgnoresDrainWorker},
    {"runtime": _UnorderedSim()},
], ids=["corrupt-drain", "no-flush", "load-overtakes-drain", "unordered-drain"])
def test_detects_broken_data_path(kw):
    """A corrupted drain copy, a flush that returns before the blocks were read, a load
    that overtakes a drain into its host blocks, and a drain that does not wait for its
    gather: each restores a wrong block within a few seeds.  (Host writes need no such
    mutant: ring drains and spills share the drain stream, which runs them in order.)"""
    for seed in range(40):
        try:
            run_random_ops(seed, 3000, **kw)
        except Corruption:
            return
    pytest.fail("no seed of 40 caught the broken worker")


@pytest.mark.parametrize("cls", [_NoTouchManager, _MRUManager])
def test_detects_lru_violation(cls):
    with pytest.raises(AssertionError, match="LRU|evicted"):
        run_random_ops(6, 3000, manager_cls=cls)


# ---- ring allocator, manager, layouts -----------------------------------------
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
