"""Two options on the ring gather's own path (worker.py, spec.py), the suspects left after
the twenty-seventh session measured the ring costing ~1 ms of wall time per piece:
``gather_stream="drain"`` (the gather queued on the drain stream, no stream of its own)
and ``gather_ids="host"`` (the gather kernel reads its block ids from pinned host memory:
``raw_issue.IdStage(mapped=True)``, no host -> device copy per piece).  On the CPU: the
id stage's mapped mode, which stream the gather takes, the refusals, the spec keys, the
fallback's log, and the worker under the randomized store/evict/load/preempt harness.
The CUDA side (a kernel reading ids through unified addressing) is in
tests/test_kv_tier_gpu.py."""

import ctypes
import logging
import random

import numpy as np
import pytest
import torch

from ion_vllm.kv_tier.raw_issue import IdStage
from ion_vllm.kv_tier.staging_ring import check_gather_ids, check_gather_stream
from ion_vllm.kv_tier.testing import run_random_ops

from tests.test_kv_tier_issue import _load, _store, _until_done
from tests.test_kv_tier_raw_issue import put_while_pending, read_ids
from tests.test_kv_tier_ring_shape import _rig


class _NoCopy:
    """A copier that fails the test if the id stage queues any copy."""

    def copy(self, dst, src, nbytes, stream):
        raise AssertionError("a mapped id stage queued a copy")


def test_a_mapped_id_stage_hands_out_the_pinned_buffer_and_queues_no_copy():
    """Each put returns an address inside the pinned buffer itself (no device buffer is
    kept) holding the ids; while earlier puts' events are pending the buffer runs out and
    puts fall back to fresh host tensors (kept alive until their event), never
    overwriting a pending region; once the events complete the buffer is used again."""
    rng = np.random.default_rng(7)
    stage = IdStage(torch.device("cpu"), _NoCopy(), capacity=16, done=lambda e: e.done,
                    mapped=True)
    assert stage.buf is None and stage.dev_base == stage.host_base
    lo, hi = stage.host_base, stage.host_base + 8 * 16
    events, in_buf = put_while_pending(stage, rng, lo, hi)
    assert stage.staged > 0 and stage.fallbacks > 0
    assert in_buf[0] and not in_buf[-1]
    for _, addr, ids in events:  # nothing pending was overwritten
        assert np.array_equal(read_ids(addr, len(ids)), ids)
    for ev, _, _ in events:
        ev.done = True
    staged = stage.staged
    addr = stage.put(np.arange(3), "S")
    assert stage.staged == staged + 1 and lo <= addr < hi


def test_an_unmapped_id_stage_still_copies_into_its_device_buffer():
    """The default stays as it was: the returned address is the device buffer's, and one
    copy of the ids' bytes is queued on the given stream."""
    calls = []

    class Rec:
        def copy(self, dst, src, nbytes, stream):
            calls.append((dst, src, nbytes, stream))
            ctypes.memmove(dst, src, nbytes)

    stage = IdStage(torch.device("cpu"), Rec(), capacity=16)
    addr = stage.put(np.array([5, 9, 2]), "S")
    assert stage.buf is not None and addr == stage.buf.data_ptr()
    assert calls == [(addr, stage.host_base, 24, "S")]
    assert np.array_equal(read_ids(addr, 3), [5, 9, 2])


def _worker(**kw):
    """``_rig``'s worker, with the priority flags of the streams its runtime made."""
    kvm, rt, w = _rig(**kw)
    return kvm, rt, w, rt.made


def test_gather_stream_drain_queues_the_gather_on_the_drain_stream():
    _, _, own, made = _worker(gather_stream="own")
    assert own._d2d is not own._drain and made == [True, False, False]  # gather, drain, load
    _, _, default, made = _worker()  # the default, "compute": no gather stream made
    assert default._d2d is None and made == [False, False]  # drain, load
    _, _, w, made = _worker(gather_stream="drain")
    assert w._d2d is w._drain and made == [False, False]  # drain, load


@pytest.mark.parametrize("stream", ["own", "drain", "compute"])
def test_one_block_jobs_round_trip_through_the_ring_on_each_gather_stream(stream):
    """A run of one-block store jobs (decode stores) through the ring with the gather on
    its own stream, on the drain stream or on the compute stream (the default;
    ``test_kv_tier_gather_compute.py``), the streams stepped at random between them, then
    loaded back elsewhere: every block byte-identical."""
    kvm, rt, w, _ = _worker(gather_stream=stream)
    rng = np.random.default_rng(11)
    data = {}
    for j, b in enumerate(range(6)):
        data[b] = kvm.random_block()
        kvm.write(b, data[b])
        _store(w, j, [b], [b])
        rt.step(random.Random(j), int(rng.integers(0, 4)))
    _until_done(rt, w, set(range(6)))
    assert w.stats.d2d_blocks == 6 and w.stats.spill_blocks == 0
    dst = list(range(10, 16))
    _load(w, 100, list(range(6)), dst)
    w.wait({100})
    rt.run_all()
    assert all(kvm.equal(d, data[b]) for d, b in zip(dst, range(6)))


@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("overflow,completion,seed", [("direct", "read", 61),
                                                      ("defer", "host", 62)])
def test_random_ops_with_the_gather_on_the_drain_stream(host_layout, overflow, completion,
                                                        seed):
    """The randomized harness with random stream interleavings and the gather queued on
    the drain stream: every restored block byte-identical to the block stored, and
    blocks through the ring."""
    r = run_random_ops(seed, 5000, overflow=overflow, completion=completion,
                       host_layout=host_layout, issue_api="raw",
                       worker_kw={"gather_stream": "drain", "gather_ids": "host"})
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert r.worker_stats["d2d_blocks"] > 0 and r.worker_stats["drained_blocks"] > 0


@pytest.mark.parametrize("fn,args,msg", [
    (check_gather_stream, ("side",), "gather_stream must be one of"),
    (check_gather_ids, ("pinned", "raw"), "gather_ids must be one of"),
    (check_gather_ids, ("host", "torch"), "needs issue_api='raw'"),
])
def test_bad_gather_path_options_are_refused(fn, args, msg):
    with pytest.raises(ValueError, match=msg):
        fn(*args)


def test_the_worker_refuses_host_ids_on_the_torch_path():
    with pytest.raises(ValueError, match="needs issue_api='raw'"):
        _worker(gather_ids="host", issue_api="torch")


def test_the_spec_reads_the_gather_path_keys_and_refuses_bad_ones():
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from tests.test_kv_tier_spec import _cfg

    base = {"cpu_bytes_to_use": 64 << 20}
    s = IonKVTierSpec(_cfg({**base, "gather_stream": "drain", "gather_ids": "host"}))
    assert (s.gather_stream, s.gather_ids) == ("drain", "host")
    d = IonKVTierSpec(_cfg(base))
    assert (d.gather_stream, d.gather_ids) == ("compute", "device")
    with pytest.raises(ValueError, match="needs issue_api='raw'"):
        IonKVTierSpec(_cfg({**base, "gather_ids": "host", "issue_api": "torch"}))
    with pytest.raises(ValueError, match="gather_stream"):
        IonKVTierSpec(_cfg({**base, "gather_stream": "side"}))


def test_host_ids_without_the_raw_path_are_said_not_to_apply(monkeypatch, caplog):
    """When the raw path cannot be built, gather_ids='host' is not applied (the torch
    gather uploads its ids), the log says so, and every block still round-trips."""
    from ion_vllm.kv_tier import worker as W

    def no_library():
        raise OSError("libcudart.so: cannot open shared object file")

    monkeypatch.setattr(W, "HostMemmove", no_library)
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        r = run_random_ops(8, 800, issue_api="raw", worker_kw={"gather_ids": "host"})
    assert "not applied: gather_ids='host'" in caplog.text
    assert r.restored_blocks > 0
