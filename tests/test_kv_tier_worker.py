"""The worker's data path on the CPU (simulated streams): which streams it makes, where
each copy of a store goes (the gather on the compute stream, the drain after it, spills
after the compute stream, loads not), what ``wait`` guarantees, and byte-identical round
trips through the ring and the spill path (worker.py's module docstring)."""

import random

import numpy as np
import pytest

from kv_tier_harness import (  # noqa: F401 (fresh_seed: a fixture)
    KVModel, fresh_seed, load, make_worker, run_random_ops, store, until_done)

from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.worker import IonKVTierWorker


class StreamLog(SimRuntime):
    """A simulated runtime that also counts the streams made."""

    def __init__(self, eager=False):
        super().__init__(eager=eager)
        self.made = 0

    def new_stream(self):
        self.made += 1
        return super().new_stream()


def _rig(ring_slots=8, num_gpu=24, host_blocks=16, verify=False):
    kvm = KVModel("ion", num_gpu, seed=3)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    rt = StreamLog()
    w = make_worker(kvm.canonical, host_blocks, ring_slots * slot, runtime=rt, verify=verify)
    return kvm, rt, w


def _ops(stream):
    """The kinds of the operations queued on a simulated stream, in order."""
    return [kind for kind, _ in stream.ops]


def _roundtrip(kvm, rt, w, gpu, host, job, dst0=15):
    data = {b: kvm.random_block() for b in gpu}
    for b, d in data.items():
        kvm.write(b, d)
    store(w, job, gpu, host)
    until_done(rt, w, {job})
    dst = [dst0 + i for i in range(len(gpu))]
    load(w, job + 1, host, dst)
    w.wait({job + 1})
    rt.run_all()
    assert all(kvm.equal(d, data[b]) for d, b in zip(dst, gpu))


def test_the_worker_makes_two_streams_and_runs_no_kernel_of_its_own():
    """A drain stream and a load stream (both at the compute stream's priority); the
    gather has no stream of its own (worker.py, "One compute stream"), and loads and GPU
    <-> host copies go through the copier."""
    _, rt, w = _rig()
    assert rt.made == 2 and w._drain is not w._load
    assert w.ring_gather_impl == "copier"  # CPU tensors: the copier's gather
    _, rt, _ = _rig(verify=True)
    assert rt.made == 3  # + the verify stream


def test_a_ring_piece_gathers_on_the_compute_stream_and_drains_after_it():
    """One store of 3 blocks through the ring (8 slots), issued inside submit_store: the
    gather's events and copies are queued on the compute stream with no wait in front of
    them (same stream as the work that wrote the blocks) and no order after the compute
    stream counted for any stream; the drain stream waits for the gather's end, then
    copies; the store's "read" event is the gather's end."""
    kvm, rt, w = _rig()
    for b in (2, 3, 5):
        kvm.write(b, kvm.random_block())
    store(w, 1, [2, 3, 5], [0, 1, 2])
    compute = rt.current_stream()
    assert _ops(compute)[0] == "rec" and _ops(compute)[-1] == "rec"
    assert "fn" in _ops(compute) and "wait" not in _ops(compute)
    assert rt.current_waits == {}
    assert _ops(w._drain)[0] == "wait" and "fn" in _ops(w._drain)
    (piece,) = w._stores[1].pieces
    assert piece.read_done is compute.ops[-1][1]
    assert w.stats.d2d_blocks == 3 and w.stats.spill_blocks == 0
    assert w.ring.alloc.used == 3


def test_a_full_ring_spills_the_rest_after_the_compute_stream():
    """A 2-slot ring and a 5-block job: 2 blocks through the ring, 3 copied GPU -> host at
    once on the drain stream, ordered after the compute stream; every block round-trips."""
    kvm, rt, w = _rig(ring_slots=2)
    _roundtrip(kvm, rt, w, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], job=1)
    assert w.stats.d2d_blocks == 2 and w.stats.spill_blocks == 3
    assert rt.current_waits == {w._drain.name: 1}
    assert w.stats.spill_bytes == 3 * w.slot_bytes and w.stats.spill_seconds > 0


def test_loads_are_not_ordered_after_the_compute_stream(fresh_seed):
    """Spills must wait for the compute stream (they read KV it just wrote); loads must
    not (tests/test_kv_tier_scheduler.py shows why that is safe): waiting delayed every
    restore by up to a forward step on the H200."""
    seen = {}

    class Captured(IonKVTierWorker):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen["w"] = self

    rt = SimRuntime()
    run_random_ops(fresh_seed, 400, runtime=rt, worker_cls=Captured, ring_slots=2)
    w = seen["w"]
    assert w.stats.load_jobs > 0 and w.stats.spill_blocks > 0
    assert rt.current_waits.get(w._drain.name, 0) > 0
    assert rt.current_waits.get(w._load.name, 0) == 0


@pytest.mark.parametrize("ring_slots", [0, 1, 8])
def test_wait_returns_once_the_source_blocks_were_read(ring_slots):
    """vLLM's flush (wait) right after a submit: when it returns, the source blocks have
    been read (gathered into the ring, or spilled), so vLLM may overwrite them; the
    restored bytes are the ones stored."""
    kvm, rt, w = _rig(ring_slots=ring_slots)
    data = {b: kvm.random_block() for b in (4, 7)}
    for b, d in data.items():
        kvm.write(b, d)
    store(w, 1, [4, 7], [3, 5])
    w.wait({1})
    for b in data:
        kvm.write(b, kvm.random_block())
    until_done(rt, w, {1})
    load(w, 2, [3, 5], [10, 11])
    until_done(rt, w, {2})
    assert kvm.equal(10, data[4]) and kvm.equal(11, data[7])


def test_a_load_waits_for_the_drain_that_rewrites_its_host_block():
    """A store into a host block that was evicted and handed out again, then a load of it
    before its drain ran: the load is ordered after that drain and restores the new bytes
    (stores are reported finished once read, so this is the case that needs the order)."""
    kvm, rt, w = _rig(ring_slots=2)
    old, new = kvm.random_block(), kvm.random_block()
    kvm.write(1, old)
    store(w, 1, [1], [4])
    until_done(rt, w, {1})
    kvm.write(2, new)
    store(w, 2, [2], [4])
    load(w, 3, [4], [12])
    until_done(rt, w, {2, 3})
    assert kvm.equal(12, new)
    assert w.stats.loads_ordered_after_drain == 1


def test_one_block_jobs_round_trip_through_the_ring():
    """Decode stores: one-block jobs through the ring, the streams stepped at random
    between them, then loaded back elsewhere: every block byte-identical."""
    kvm, rt, w = _rig()
    rng = np.random.default_rng(11)
    data = {}
    for j, b in enumerate(range(6)):
        data[b] = kvm.random_block()
        kvm.write(b, data[b])
        store(w, j, [b], [b])
        rt.step(random.Random(j), int(rng.integers(0, 4)))
    until_done(rt, w, set(range(6)))
    assert w.stats.d2d_blocks == 6 and w.stats.spill_blocks == 0
    dst = list(range(10, 16))
    load(w, 100, list(range(6)), dst)
    w.wait({100})
    rt.run_all()
    assert all(kvm.equal(d, data[b]) for d, b in zip(dst, range(6)))


def test_ring_slots_come_back_once_drained_and_shutdown_syncs_everything():
    kvm, rt, w = _rig(ring_slots=4)
    for b in range(4):
        kvm.write(b, kvm.random_block())
    store(w, 1, [0, 1, 2, 3], [0, 1, 2, 3])
    assert w.ring.alloc.used == 4
    until_done(rt, w, {1})
    w.get_finished()
    assert w.ring.alloc.used == 0 and w.stats.drained_blocks == 4
    store(w, 2, [0, 1], [4, 5])
    w.shutdown()
    assert rt.pending_ops == 0 and not w._ring_pieces


def test_no_ring_copies_every_block_directly():
    kvm, rt, w = _rig(ring_slots=0)
    assert w.ring.num_slots == 0 and w.ring.nbytes == 0
    _roundtrip(kvm, rt, w, [3, 4, 5], [0, 1, 2], job=1)
    assert w.stats.spill_blocks == 3 and w.stats.d2d_blocks == 0


def test_a_ring_smaller_than_a_block_is_refused():
    kvm = KVModel("ion", 4, seed=1)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    with pytest.raises(ValueError, match="cannot hold one KV block"):
        make_worker(kvm.canonical, 2, slot // 2)


def test_the_store_result_reports_the_bytes_and_a_time():
    kvm, rt, w = _rig(ring_slots=1)
    for b in (1, 2):
        kvm.write(b, kvm.random_block())
    store(w, 7, [1, 2], [0, 1])
    rt.run_all()
    (res,) = w.get_finished()
    assert res.job_id == 7 and res.success and res.transfer_size == 2 * w.slot_bytes
    assert res.transfer_time > 0


# ---- the host pool (host_pool.py) ----------------------------------------------------
def test_the_host_pool_is_exactly_the_size_asked_and_locked_once():
    from ion_vllm.kv_tier.host_pool import HostPool

    calls = []
    pool = HostPool(37, 3 * 4096 + 8, pin=True,
                    register=lambda p, n: calls.append(("reg", p, n)),
                    unregister=lambda p: calls.append(("unreg", p)))
    t = pool.tensor
    assert t.shape == (37, 3 * 4096 + 8) and t.dtype.itemsize == 1 and t.is_contiguous()
    assert calls == [("reg", t.data_ptr(), 37 * (3 * 4096 + 8))]  # not a power of two
    assert pool.pinned and t.data_ptr() % 4096 == 0
    t[-1, -1] = 7  # writable to its last byte
    pool.close()
    pool.close()
    assert calls[1:] == [("unreg", t.data_ptr())]


def test_a_host_pool_that_cannot_be_locked_stays_pageable_and_says_so(caplog):
    import logging

    from ion_vllm.kv_tier.host_pool import HostPool

    with caplog.at_level(logging.WARNING):
        pool = HostPool(4, 1024, pin=True, register=lambda p, n: "out of memory",
                        unregister=lambda p: pytest.fail("nothing to unlock"))
    assert not pool.pinned and pool.tensor.shape == (4, 1024)
    assert any("could not page-lock" in m and "out of memory" in m for m in caplog.messages)
    pool.close()


def test_vllm_s_connector_reports_what_the_ion_worker_failed():
    """vllm_guards.install_load_error_reporting: the OffloadingConnector (worker role)
    names the Ion worker's invalid blocks once; other specs' workers keep vLLM's
    answer (none)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector)

    from ion_vllm.kv_tier.vllm_guards import install_load_error_reporting

    install_load_error_reporting()
    install_load_error_reporting()  # idempotent
    kvm, rt, w = _rig()
    w._invalid_gpu.update({3, 9})
    conn = object.__new__(OffloadingConnector)
    conn.connector_worker = SimpleNamespace(worker=w)
    assert conn.get_block_ids_with_load_errors() == {3, 9}
    assert conn.get_block_ids_with_load_errors() == set()
    conn.connector_worker = SimpleNamespace(worker=object())  # another spec's worker
    assert conn.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("layout", ["ion", "kv_first"])
@pytest.mark.parametrize("ring_slots", [8, 0], ids=["ring", "spill"])
def test_fp8_cache_blocks_are_half_the_size_and_restore_byte_exact(layout, ring_slots,
                                                                 fresh_seed):
    """An fp8 KV cache (vLLM allocates it as uint8 and views it as e4m3): the tier moves
    bytes, so a host block is half a bf16 block and every byte pattern comes back."""
    import torch

    fp8 = KVModel(layout, 24, seed=fresh_seed, dtype=torch.uint8)
    bf16 = KVModel(layout, 24, seed=fresh_seed)
    slot = sum(c.page_size_bytes for c in fp8.canonical.tensors)
    assert 2 * slot == sum(c.page_size_bytes for c in bf16.canonical.tensors)
    rt = SimRuntime()
    w = make_worker(fp8.canonical, 16, ring_slots * slot, runtime=rt)
    assert w.slot_bytes == slot and w.host.shape == (16, slot)
    _roundtrip(fp8, rt, w, [1, 2, 3, 9], [4, 5, 6, 7], job=1)
