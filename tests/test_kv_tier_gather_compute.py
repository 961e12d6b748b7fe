"""``gather_stream="compute"`` (worker.py, "One compute stream"): the GPU -> ring gather
queued on the compute stream as it is at issue time, so that the tier runs no kernel on a
stream of its own (with ``load_copy="copier"``: bench config ``ion-onestream``, the
defaults since the thirty-first session).  On the CPU: which streams the worker makes and
where each copy of a ring piece goes, that the gather needs no cross-stream wait, that
flush bypasses stay off the compute stream, the spec key and the defaults, and the
randomized store/evict/load/preempt harness under random interleavings of the compute
stream with the others.  The byte-for-byte round trip of decode stores is
``test_kv_tier_gather_path.py``'s, parametrized over the three gather streams; the CUDA
side is in tests/test_kv_tier_gpu.py."""

import pytest

from ion_vllm.kv_tier.staging_ring import check_gather_stream
from ion_vllm.kv_tier.testing import run_random_ops

from tests.test_kv_tier_issue import _load, _store, _until_done
from tests.test_kv_tier_ring_shape import _rig


def _ops(stream):
    """The kinds of the operations queued on a simulated stream, in order."""
    return [kind for kind, _ in stream.ops]


def test_the_compute_gather_makes_no_stream_of_its_own():
    _, rt, w = _rig(gather_stream="compute")
    assert w._d2d is None and rt.made == [False, False]  # drain, load
    assert w._bypass_stream is w._drain
    _, rt, own = _rig(gather_stream="own")
    assert own._bypass_stream is own._d2d and rt.made == [True, False, False]


def test_a_ring_piece_gathers_on_the_compute_stream_and_drains_after_it():
    """One store of 3 blocks through the ring (8 slots): the gather's events and copies are
    queued on the compute stream with no wait in front of them (same stream as the work
    that wrote the blocks) and no order after the compute stream counted for any stream;
    the drain stream waits for the gather's end, then copies."""
    kvm, rt, w = _rig(gather_stream="compute")
    for b in (2, 3, 5):
        kvm.write(b, kvm.random_block())
    _store(w, 1, [2, 3, 5], [0, 1, 2])
    compute = rt.current_stream()
    assert _ops(compute)[0] == "rec" and _ops(compute)[-1] == "rec"
    assert "fn" in _ops(compute) and "wait" not in _ops(compute)
    assert rt.current_waits == {}
    assert _ops(w._drain)[0] == "wait" and "fn" in _ops(w._drain)
    (piece,) = w._stores[1].pieces
    assert piece.read_done is compute.ops[-1][1]  # the gather's end: the store's "read"
    assert w.stats.d2d_blocks == 3 and w.stats.spill_blocks == 0


def test_a_flush_bypass_goes_to_the_drain_stream_not_the_compute_stream():
    """overflow="defer" with a ring of 2 slots: a 4-block store leaves 2 blocks deferred;
    flushing it (``wait``) copies them GPU -> host on the drain stream (after the compute
    stream), and every block of the job round-trips."""
    kvm, rt, w = _rig(ring_slots=2, gather_stream="compute", overflow="defer")
    data = {b: kvm.random_block() for b in (1, 4, 6, 7)}
    for b, d in data.items():
        kvm.write(b, d)
    _store(w, 3, list(data), [0, 1, 2, 3])
    assert w.stats.deferred_blocks == 2
    launched = []
    real = rt.launch
    rt.launch = lambda stream, fn: (launched.append(stream.name), real(stream, fn))[1]
    w.wait({3})
    assert w.stats.bypass_blocks == 2
    assert rt.current_waits.get(w._drain.name, 0) == 1
    assert launched and set(launched) == {w._drain.name}  # nothing on the compute stream
    _until_done(rt, w, {3})
    dst = [10, 11, 12, 13]
    _load(w, 4, [0, 1, 2, 3], dst)
    w.wait({4})
    rt.run_all()
    assert all(kvm.equal(d, data[b]) for d, b in zip(dst, data))


@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("overflow,completion,issue_at,seed", [
    ("direct", "read", "submit", 71), ("defer", "host", "submit", 72),
    ("direct", "read", "finish", 73)])
def test_random_ops_with_the_gather_on_the_compute_stream(host_layout, overflow, completion,
                                                          issue_at, seed):
    """The randomized harness with the gather on the compute stream and loads through the
    copier (the ``ion-onestream`` data path), the compute stream's queued work run in random
    interleavings with the drain and load streams: every restored block byte-identical to
    the block stored, and blocks through the ring."""
    r = run_random_ops(seed, 5000, overflow=overflow, completion=completion,
                       host_layout=host_layout, issue_api="raw", issue_at=issue_at,
                       load_copy="copier", worker_kw={"gather_stream": "compute"})
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0 and r.worker_stats["drained_blocks"] > 0


def test_the_spec_reads_compute_and_still_refuses_other_streams():
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from tests.test_kv_tier_spec import _cfg

    base = {"cpu_bytes_to_use": 64 << 20}
    s = IonKVTierSpec(_cfg({**base, "gather_stream": "compute", "load_copy": "copier"}))
    assert (s.gather_stream, s.load_copy) == ("compute", "copier")
    assert check_gather_stream("compute") == "compute"
    with pytest.raises(ValueError, match="gather_stream must be one of"):
        IonKVTierSpec(_cfg({**base, "gather_stream": "side"}))


def test_the_one_stream_path_is_the_default_of_the_spec_and_the_worker():
    """Since the thirty-first session (measured 1.010 of native's throughput against the
    side-stream pair's 0.994) the spec and the worker default to the gather on the compute
    stream and copy-engine loads; the spec hands both to the worker it builds."""
    import inspect

    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from ion_vllm.kv_tier.worker import IonKVTierWorker
    from tests.test_kv_tier_spec import _cfg

    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 64 << 20}))
    assert (s.gather_stream, s.load_copy) == ("compute", "copier")
    params = inspect.signature(IonKVTierWorker).parameters
    assert (params["gather_stream"].default, params["load_copy"].default) == ("compute",
                                                                               "copier")
    _, rt, w = _rig()
    assert w._d2d is None and w.load_copy_impl == "copier" and rt.made == [False, False]


def test_the_bench_configs_of_the_stream_paths():
    """The bench configs that name stream keys name both, so that each stays the path it
    measured whichever pair is the default."""
    from script_loader import load_script

    ION_CONFIGS = load_script("kv_tier_bench.py", "kv_tier_bench_onestream").ION_CONFIGS
    assert ION_CONFIGS["ion"] == {}
    assert ION_CONFIGS["ion-gather-compute"] == {"gather_stream": "compute",
                                                 "load_copy": "auto"}
    assert ION_CONFIGS["ion-onestream"] == {"gather_stream": "compute",
                                            "load_copy": "copier"}
    assert ION_CONFIGS["ion-noring-ceload"] == {"ring_mib": 0, "load_copy": "copier"}
    assert ION_CONFIGS["ion-sidestreams"] == {"gather_stream": "own", "load_copy": "auto"}
    assert ION_CONFIGS["ion-ceload"] == {"gather_stream": "own", "load_copy": "copier"}
    assert ION_CONFIGS["ion-gather-normal"] == {"gather_stream": "own",
                                                "gather_priority": "normal"}
