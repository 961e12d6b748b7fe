"""The test-only host-time probe (spec keys ``host_delay_us`` / ``host_delay_at``): each
store job costs that much extra host time, inside ``submit_store`` or in the next
``get_finished``, and nothing else changes (same bytes on the host)."""

import time

import pytest

from test_kv_tier_issue import _load, _rig as issue_rig, _store, _until_done

DELAY_US = 20_000  # large against the CPU worker's own cost, so the bounds are robust


def _rig(at, us=DELAY_US):
    return issue_rig("submit", seed=3, host_delay_us=us, host_delay_at=at)


def _fill(kvm, blocks):
    data = {b: kvm.random_block() for b in blocks}
    for b, d in data.items():
        kvm.write(b, d)
    return data


def _round_trip_ok(kvm, rt, w, data, host_of):
    """Load each stored host block into a scrubbed GPU block and compare the bytes."""
    dst = {g: 10 + i for i, g in enumerate(data)}
    for d in dst.values():
        kvm.scrub(d)
    _load(w, 99, [host_of[g] for g in data], [dst[g] for g in data])
    _until_done(rt, w, {99})
    return all(kvm.equal(dst[g], data[g]) for g in data)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def test_submit_point_spends_the_delay_in_each_submit_store():
    kvm, rt, w = _rig("submit")
    data = _fill(kvm, [2, 3, 5])
    dt1, _ = _timed(lambda: _store(w, 1, [2, 3], [0, 1]))
    dt2, _ = _timed(lambda: _store(w, 2, [5], [2]))
    assert min(dt1, dt2) >= DELAY_US * 1e-6
    assert w._host_delay_owed == 0
    _until_done(rt, w, {1, 2})
    assert _round_trip_ok(kvm, rt, w, data, {2: 0, 3: 1, 5: 2})


def test_finish_point_moves_the_delay_of_every_job_into_the_next_get_finished():
    kvm, rt, w = _rig("finish")
    data = _fill(kvm, [2, 3, 5])
    dt1, _ = _timed(lambda: _store(w, 1, [2, 3], [0, 1]))
    dt2, _ = _timed(lambda: _store(w, 2, [5], [2]))
    assert max(dt1, dt2) < DELAY_US * 1e-6
    assert w._host_delay_owed == 2
    dt, _ = _timed(w.get_finished)
    assert dt >= 2 * DELAY_US * 1e-6 and w._host_delay_owed == 0
    dt, _ = _timed(w.get_finished)  # nothing owed any more
    assert dt < DELAY_US * 1e-6
    _until_done(rt, w, {1, 2})
    assert _round_trip_ok(kvm, rt, w, data, {2: 0, 3: 1, 5: 2})


def test_off_by_default_and_bad_values_refused():
    kvm, rt, w = _rig("submit", us=0)
    assert w._host_delay_s == 0
    _store(w, 1, [2], [0])
    assert w._host_delay_owed == 0
    with pytest.raises(ValueError, match="host_delay_us"):
        _rig("submit", us=-1)
    with pytest.raises(ValueError, match="host_delay_at"):
        _rig("later")


def test_spec_keys_reach_the_worker():
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from test_kv_tier_spec import _cfg, worker_of

    w = worker_of({"host_delay_us": 500, "host_delay_at": "finish"})
    assert w._host_delay_s == pytest.approx(500e-6) and w.host_delay_at == "finish"
    assert worker_of({})._host_delay_s == 0
    with pytest.raises(ValueError, match="host_delay_at"):
        IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 << 10, "host_delay_at": "never"}))
