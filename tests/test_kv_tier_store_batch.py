"""Store batching (worker.py, "Store batching"; spec keys ``store_batch_blocks`` /
``store_batch_steps``): small store jobs are held and issued together as one job, one
ring piece for several decode stores.  On the CPU: when held jobs are issued (the block
count, the age, a larger job, a flush, shutdown), that each is reported under its own id
with its own size, that the blocks round-trip byte for byte, the refusals and spec keys,
and the randomized store/evict/load/preempt harness with batching on.  The CUDA run of
the harness is in tests/test_kv_tier_gpu.py."""

import numpy as np
import pytest

from ion_vllm.kv_tier.staging_ring import check_store_batch
from ion_vllm.kv_tier.testing import run_random_ops

from tests.test_kv_tier_issue import _load, _store, _until_done
from tests.test_kv_tier_ring_shape import _rig


def _finished(rt, w):
    rt.run_all()
    return {r.job_id: r for r in w.get_finished()}


def _write(kvm, blocks):
    data = {b: kvm.random_block() for b in blocks}
    for b, d in data.items():
        kvm.write(b, d)
    return data


def _restores(kvm, rt, w, data, host_of, job):
    """Load the stored blocks back into other GPU blocks; True if all byte-identical."""
    src = sorted(data)
    dst = [18 + i for i in range(len(src))]
    _load(w, job, [host_of[b] for b in src], dst)
    w.wait({job})
    rt.run_all()
    return all(kvm.equal(d, data[b]) for d, b in zip(dst, src))


def test_small_jobs_are_held_until_they_hold_k_blocks_then_go_as_one_ring_piece():
    """K=4: three one-block jobs queue no GPU work and finish nothing; the fourth issues
    all four as one ring piece (one gather, 4 blocks); each job is then reported under its
    own id with its own size, and every block restores byte for byte."""
    kvm, rt, w = _rig(store_batch_blocks=4)
    data = _write(kvm, [1, 2, 3, 4])
    for j, b in enumerate([1, 2, 3]):
        _store(w, 10 + j, [b], [b])
    assert rt.pending_ops == 0 and len(w._ring_pieces) == 0
    assert _finished(rt, w) == {}
    _store(w, 13, [4], [4])
    assert len(w._ring_pieces) == 1 and w._ring_pieces[0].count == 4
    w.check_invariants()
    done = {}
    for _ in range(5):
        done.update(_finished(rt, w))
    assert set(done) == {10, 11, 12, 13}
    assert all(r.transfer_size == w.slot_bytes for r in done.values())
    assert w.stats.store_batches == 1 and w.stats.batched_store_jobs == 4
    assert w.stats.d2d_blocks == 4 and w._batch_of == {}
    assert _restores(kvm, rt, w, data, {b: b for b in data}, job=99)


def test_a_held_job_is_issued_once_it_has_waited_store_batch_steps():
    kvm, rt, w = _rig(store_batch_blocks=8, store_batch_steps=3)
    data = _write(kvm, [5])
    _store(w, 1, [5], [7])
    assert _finished(rt, w) == {} and _finished(rt, w) == {}  # ages 1, 2
    assert w.stats.d2d_blocks == 0
    done = {}
    for _ in range(4):  # age 3: issued alone (a batch of one is the job itself)
        done.update(_finished(rt, w))
    assert set(done) == {1} and w.stats.d2d_blocks == 1 and w.stats.store_batches == 0
    assert _restores(kvm, rt, w, data, {5: 7}, job=2)


def test_a_job_of_k_blocks_or_more_issues_the_held_jobs_first():
    """Submission order is kept: the held jobs' piece comes before the large job's."""
    kvm, rt, w = _rig(store_batch_blocks=3)
    _write(kvm, [1, 2, 3, 4, 5])
    _store(w, 1, [1], [1])
    _store(w, 2, [2], [2])
    _store(w, 3, [3, 4, 5], [3, 4, 5])
    pieces = list(w._ring_pieces)
    assert [p.count for p in pieces] == [2, 3]
    assert pieces[0].job.members == [(1, w.slot_bytes), (2, w.slot_bytes)]
    assert pieces[1].job.job_id == 3
    assert set(_until_done(rt, w, {1, 2, 3})) >= {1, 2, 3}


def test_a_flush_of_a_held_job_issues_it_and_waits_for_its_read():
    """vLLM flushes (wait) a store before it reuses the source blocks: the held job
    must be issued and read by the time wait returns, its batch-mate with it."""
    kvm, rt, w = _rig(store_batch_blocks=8)
    data = _write(kvm, [3, 6])
    _store(w, 1, [3], [0])
    _store(w, 2, [6], [1])
    w.wait({2})
    (p,) = w._ring_pieces
    assert p.count == 2 and rt.query(p.read_done)
    kvm.write(3, kvm.random_block())  # the source blocks may be reused now
    kvm.write(6, kvm.random_block())
    assert set(_until_done(rt, w, {1, 2})) >= {1, 2}
    assert _restores(kvm, rt, w, data, {3: 0, 6: 1}, job=9)


def test_shutdown_issues_and_completes_held_jobs():
    kvm, rt, w = _rig(store_batch_blocks=8)
    _write(kvm, [2])
    _store(w, 1, [2], [3])
    w.shutdown()
    assert w.stats.d2d_blocks == 1 and w._held == []


def test_a_batch_time_is_shared_by_bytes():
    """vLLM sums transfer_time per job: the members' times add up to the batch's."""
    kvm, rt, w = _rig(store_batch_blocks=3)
    _write(kvm, [1, 2, 3])
    _store(w, 1, [1], [1])
    _store(w, 2, [2, 3], [2, 3])
    done = {}
    for _ in range(5):
        done.update(_finished(rt, w))
    assert done[1].transfer_size * 2 == done[2].transfer_size
    assert done[2].transfer_time == pytest.approx(2 * done[1].transfer_time)


@pytest.mark.parametrize("issue_at,overflow,completion,ring,seed", [
    ("submit", "direct", "read", 6, 71),
    ("finish", "defer", "host", 6, 72),
    ("submit", "direct", "read", 0, 73),  # no ring: batches of direct copies
])
def test_random_ops_with_store_batching(issue_at, overflow, completion, ring, seed):
    """The randomized harness (random stream interleavings, evictions, preemptions and
    flushes) with batching on: every restored block byte-identical to the block stored,
    and batches formed."""
    r = run_random_ops(seed, 5000, overflow=overflow, completion=completion,
                       issue_at=issue_at, ring_slots=ring, issue_api="raw",
                       worker_kw={"store_batch_blocks": 4, "store_batch_steps": 3})
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert r.worker_stats["store_batches"] > 10
    assert r.worker_stats["batched_store_jobs"] > 2 * r.worker_stats["store_batches"]


@pytest.mark.parametrize("blocks,steps,key", [(-1, 8, "store_batch_blocks"),
                                              (2.5, 8, "store_batch_blocks"),
                                              (4, 0, "store_batch_steps"),
                                              (4, 1.5, "store_batch_steps")])
def test_bad_store_batch_values_are_refused(blocks, steps, key):
    with pytest.raises(ValueError, match=key):
        check_store_batch(blocks, steps)


def test_the_spec_reads_the_store_batch_keys_and_refuses_bad_ones():
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from tests.test_kv_tier_spec import _cfg

    base = {"cpu_bytes_to_use": 64 << 20}
    s = IonKVTierSpec(_cfg({**base, "store_batch_blocks": 8, "store_batch_steps": 4}))
    assert (s.store_batch_blocks, s.store_batch_steps) == (8, 4)
    d = IonKVTierSpec(_cfg(base))
    assert (d.store_batch_blocks, d.store_batch_steps) == (0, 8)
    with pytest.raises(ValueError, match="store_batch_steps"):
        IonKVTierSpec(_cfg({**base, "store_batch_blocks": 8, "store_batch_steps": 0}))


def test_batching_off_issues_every_job_at_once():
    kvm, rt, w = _rig()
    _write(kvm, [1, 2])
    _store(w, 1, [1], [1])
    _store(w, 2, [2], [2])
    assert [p.count for p in w._ring_pieces] == [1, 1] and w._held == []
    assert np.array_equal(w._ring_pieces[1].job.gpu, [2])
