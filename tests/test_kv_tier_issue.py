"""When the KV tier worker issues a submitted transfer's GPU work (``issue_at``,
worker.py "Issue"): at the next get_finished / wait by default, inside the submit call
with "submit"; the same bytes arrive either way, in submission order."""

import pytest
from vllm.v1.kv_offload.base import GPULoadStoreSpec

from ion_vllm.kv_tier.manager import IonHostSpec
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.testing import KVModel
from ion_vllm.kv_tier.worker import IonKVTierWorker


def _rig(issue_at, ring_slots=4, seed=0, **worker_kw):
    kvm = KVModel("ion", 16, seed=seed)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    rt = SimRuntime(eager=False)
    w = IonKVTierWorker(kvm.canonical, num_host_blocks=8, ring_bytes=ring_slots * slot,
                        runtime=rt, copier="torch", pin_memory=False, log_interval_s=0,
                        issue_at=issue_at, **worker_kw)
    return kvm, rt, w


def _store(w, job, gpu, host):
    w.submit_store(job, GPULoadStoreSpec(list(gpu), [len(gpu)], [0]), IonHostSpec(list(host)))


def _load(w, job, host, gpu):
    w.submit_load(job, IonHostSpec(list(host)), GPULoadStoreSpec(list(gpu), [len(gpu)], [0]))


def _until_done(rt, w, jobs):
    done = set()
    for _ in range(50):
        rt.run_all()
        done |= {r.job_id for r in w.get_finished()}
        if jobs <= done:
            return done
    raise AssertionError(f"never finished: {jobs - done}")


def test_finish_issues_nothing_inside_submit_and_everything_at_get_finished():
    kvm, rt, w = _rig("finish")
    _store(w, 1, [2, 3, 5], [0, 1, 2])  # 3 blocks: all through the ring (4 slots)
    _load(w, 2, [6], [9])
    assert rt.pending_ops == 0  # nothing queued on any stream yet
    assert w.ring.alloc.used == 0 and 2 not in w._loads
    w.get_finished()
    assert rt.pending_ops > 0 and w.ring.alloc.used == 3 and 2 in w._loads


def test_submit_issues_inside_the_submit_call():
    kvm, rt, w = _rig("submit")
    _store(w, 1, [2, 3, 5], [0, 1, 2])
    assert rt.pending_ops > 0 and w.ring.alloc.used == 3
    n = rt.pending_ops
    _load(w, 2, [6], [9])
    assert rt.pending_ops > n and 2 in w._loads


@pytest.mark.parametrize("issue_at", ["finish", "submit"])
def test_wait_issues_first_then_the_source_blocks_are_read(issue_at):
    """vLLM's flush (wait) right after a submit, with no get_finished between: the job is
    issued by wait itself, and its source blocks have been read when wait returns."""
    kvm, rt, w = _rig(issue_at, ring_slots=1)  # 1 slot: the second block spills
    data = {b: kvm.random_block() for b in (4, 7)}
    for b, d in data.items():
        kvm.write(b, d)
    _store(w, 1, [4, 7], [3, 5])
    w.wait({1})
    for b in data:  # vLLM may now overwrite the source blocks
        kvm.write(b, kvm.random_block())
    _until_done(rt, w, {1})
    _load(w, 2, [3, 5], [10, 11])
    _until_done(rt, w, {2})
    assert kvm.equal(10, data[4]) and kvm.equal(11, data[7])


def test_finish_keeps_submission_order_between_a_store_and_a_load_of_its_host_block():
    """A load of a host block submitted after the store that (re)writes it is ordered after
    that store's drain: both are issued in one get_finished, store first."""
    kvm, rt, w = _rig("finish", ring_slots=2)
    old, new = kvm.random_block(), kvm.random_block()
    kvm.write(1, old)
    _store(w, 1, [1], [4])
    _until_done(rt, w, {1})
    kvm.write(2, new)
    _store(w, 2, [2], [4])  # host block 4 rewritten (evicted and handed out again)
    _load(w, 3, [4], [12])
    _until_done(rt, w, {2, 3})
    assert kvm.equal(12, new)
    assert w.stats.loads_ordered_after_drain >= 1


def test_shutdown_issues_what_was_submitted():
    kvm, rt, w = _rig("finish")
    d = kvm.random_block()
    kvm.write(2, d)
    _store(w, 1, [2], [0])
    w.shutdown()
    assert w.stats.d2d_blocks == 1 and not w._submitted


def test_bad_issue_point_is_refused():
    kvm = KVModel("ion", 4, seed=1)
    with pytest.raises(ValueError, match="issue_at"):
        IonKVTierWorker(kvm.canonical, num_host_blocks=2, ring_bytes=0, runtime=SimRuntime(),
                        copier="torch", pin_memory=False, issue_at="later")


def test_finish_orders_a_store_after_its_submit_time_mark():
    """issue_at="finish", with the gather on a stream of its own: the store's copies are
    ordered after the compute stream's mark taken at submit (counted as an order after the
    compute stream), not left unordered."""
    kvm, rt, w = _rig("finish", ring_slots=1, gather_stream="own")  # 1 ring block, 1 spilled
    _store(w, 1, [2, 3], [0, 1])
    assert w._stores[1].after is not None and rt.current_waits == {}
    w.get_finished()
    assert sum(rt.current_waits.values()) == 2  # the gather's stream and the spill's
    kvm2, rt2, w2 = _rig("submit", ring_slots=1, gather_stream="own")
    _store(w2, 1, [2, 3], [0, 1])
    assert w2._stores[1].after is None and sum(rt2.current_waits.values()) == 2
