"""The idle-ring probe (worker.py, "Idle-ring probe"; spec key ``ring_idle``, test-only):
the staging ring is made as configured but no store uses it, so every block takes the
direct GPU -> host path of ``ring_mib`` 0.  On the CPU: the ring exists and stays empty,
blocks are spilled and round-trip byte for byte, the refusals, the spec key, and the
randomized harness with the probe on.  The bench config ``ion-ringidle`` runs it on the
GPU against ``ion-noring``."""

import pytest

from ion_vllm.kv_tier.testing import run_random_ops

from tests.test_kv_tier_ring_shape import _rig, _roundtrip


def test_an_idle_ring_is_allocated_but_every_block_goes_to_the_host_directly():
    kvm, rt, w = _rig(ring_slots=8, ring_idle=True)
    assert w.ring.num_slots == 8 and w.ring.nbytes == 8 * w.slot_bytes
    _roundtrip(kvm, rt, w, gpu=[1, 2, 3], host=[4, 5, 6], job=1)
    _roundtrip(kvm, rt, w, gpu=[7], host=[8], job=3)
    assert w.stats.spill_blocks == 4
    assert w.stats.d2d_blocks == 0 and w.stats.drained_blocks == 0
    assert w.ring.alloc.peak == 0 and w._ring_pieces == type(w._ring_pieces)()
    w.check_invariants()


def test_without_the_probe_the_same_stores_use_the_ring():
    """The control of the test above: the same rig and stores, the ring takes them."""
    kvm, rt, w = _rig(ring_slots=8)
    _roundtrip(kvm, rt, w, gpu=[1, 2, 3], host=[4, 5, 6], job=1)
    assert w.stats.d2d_blocks == 3 and w.stats.spill_blocks == 0


@pytest.mark.parametrize("kw,match", [
    ({"ring_slots": 8, "overflow": "defer"}, "ring_overflow='direct'"),
    ({"ring_slots": 0}, "needs a ring"),
])
def test_the_probe_is_refused_where_it_means_nothing_or_would_stall(kw, match):
    with pytest.raises(ValueError, match=match):
        _rig(ring_idle=True, **kw)


def test_the_spec_reads_ring_idle_and_refuses_it_with_a_deferring_ring_or_no_ring():
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from tests.test_kv_tier_spec import _cfg

    base = {"cpu_bytes_to_use": 64 << 20}
    assert IonKVTierSpec(_cfg({**base, "ring_idle": True})).ring_idle is True
    assert IonKVTierSpec(_cfg({**base, "ring_idle": "false"})).ring_idle is False
    assert IonKVTierSpec(_cfg(base)).ring_idle is False
    with pytest.raises(ValueError, match="ring_idle"):
        IonKVTierSpec(_cfg({**base, "ring_idle": True, "ring_overflow": "defer"}))
    # refused at the spec, not first in the worker, when there is no ring to leave idle
    with pytest.raises(ValueError, match="needs a ring"):
        IonKVTierSpec(_cfg({**base, "ring_idle": True, "ring_mib": 0}))


@pytest.mark.parametrize("issue_at,seed", [("submit", 81), ("finish", 82)])
def test_random_ops_with_an_idle_ring(issue_at, seed):
    """The randomized harness (stream interleavings, evictions, preemptions, flushes) with
    the probe on: every restored block byte-identical, and not one block through the ring."""
    r = run_random_ops(seed, 3000, overflow="direct", completion="read",
                       issue_at=issue_at, ring_slots=6, issue_api="raw",
                       worker_kw={"ring_idle": True})
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] == 0 and r.worker_stats["spill_blocks"] > 100
