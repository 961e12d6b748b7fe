"""The ring path's three shape options (worker.py, spec.py): the drain cut into bounded
copies (``drain_chunk_kib``), bulk store jobs kept off the ring (``ring_max_job_blocks``)
and the gather's stream priority (``gather_priority``).  On the CPU: the chunking
arithmetic against a reference, the chunked pointer drain byte for byte against the torch
copier, which blocks take which path, the refusals, and the worker under the randomized
store/evict/load/preempt harness with every option on.  The CUDA side (the batched
driver call) is in tests/test_kv_tier_gpu.py."""

import logging
import numpy as np
import pytest

from ion_vllm.kv_tier.raw_issue import HostMemmove, PointerDrain, chunked
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.staging_ring import check_ring_shape
from ion_vllm.kv_tier.testing import (
    RING_SHAPE_OPTIONS,
    KVModel,
    run_random_ops,
    took_ring_and_direct_paths,
)
from ion_vllm.kv_tier.worker import IonKVTierWorker

from tests.test_kv_tier_issue import _load, _store, _until_done
from tests.test_kv_tier_raw_issue import CountingMemmove, _buffers


def _chunked_reference(copies, chunk):
    out = []
    for dst, src, n in copies:
        off = 0
        while off < n:
            k = min(chunk, n - off)
            out.append((dst + off, src + off, k))
            off += k
    return out


@pytest.mark.parametrize("seed", range(3))
def test_chunked_matches_a_reference_split(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        chunk = 16 * int(rng.integers(1, 20))
        copies = [(int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 40)),
                   16 * int(rng.integers(1, 60))) for _ in range(int(rng.integers(1, 7)))]
        d, s, z = chunked(copies, chunk)
        assert list(zip(d.tolist(), s.tolist(), z.tolist())) == \
            _chunked_reference(copies, chunk)
        assert int(z.sum()) == sum(n for _, _, n in copies) and z.max() <= chunk


@pytest.mark.parametrize("chunk", [16, 128, 400, 1 << 20])
@pytest.mark.parametrize("layout", ["slot", "tensor"])
def test_chunked_pointer_drain_matches_the_torch_copier(layout, chunk):
    """Random ring runs into random host rows, the drain cut into copies of at most
    ``chunk`` bytes: the host buffer ends exactly as the torch copier's drain leaves it,
    and no copy is larger than the chunk."""
    rng = np.random.default_rng(7)
    sizes = []

    for trial in range(40):
        pages, cp, ring, host = _buffers(rng, layout)
        ref = host.clone()
        n = int(rng.integers(1, 6))
        start = int(rng.integers(0, 7 - n + 1))
        if rng.random() < 0.5:
            h0 = int(rng.integers(0, 9 - n + 1))
            hids = np.arange(h0, h0 + n)
        else:
            hids = rng.choice(9, n, replace=False)
        PointerDrain(ring, host, layout, cp.placement, pages, CountingMemmove(sizes),
                     chunk_bytes=chunk)(start, hids.tolist(), None)
        cp.drain(ring, start, ref, hids)
        assert ref.equal(host), (layout, chunk, trial)
    assert max(sizes) <= chunk


def test_chunked_drain_goes_through_batch_in_one_call():
    """With ``batch`` the pieces leave in one call (the batched driver call on CUDA),
    none larger than the chunk, covering the unchunked copies exactly."""
    rng = np.random.default_rng(2)
    pages, cp, ring, host = _buffers(rng, "slot")
    calls = []

    def batch(src, dst, sizes, stream):
        calls.append((src.copy(), dst.copy(), sizes.copy(), stream))

    drain = PointerDrain(ring, host, "slot", cp.placement, pages, HostMemmove(),
                         chunk_bytes=256, batch=batch)
    drain(1, [3, 4, 5, 0], "S")
    (src, dst, sizes, stream), = calls
    assert stream == "S" and sizes.max() <= 256
    whole = drain.copies(1, [3, 4, 5, 0])
    assert [n for _, _, n in whole] == [3 * sum(pages), sum(pages)]
    assert int(sizes.sum()) == 4 * sum(pages)
    d, s, z = chunked(whole, 256)
    assert np.array_equal(src, s) and np.array_equal(dst, d) and np.array_equal(sizes, z)


class StreamLog(SimRuntime):
    """A simulated runtime that also records, in ``made``, the priority flag of each stream
    made, in order."""

    def __init__(self, eager=False):
        super().__init__(eager=eager)
        self.made = []

    def new_stream(self, high_priority=False):
        self.made.append(high_priority)
        return super().new_stream(high_priority=high_priority)


def _rig(ring_slots=8, **kw):
    kvm = KVModel("ion", 24, seed=3)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    rt = StreamLog(eager=False)
    w = IonKVTierWorker(kvm.canonical, num_host_blocks=16, ring_bytes=ring_slots * slot,
                        runtime=rt, copier="torch", pin_memory=False, log_interval_s=0,
                        issue_at="submit", **kw)
    return kvm, rt, w


def _roundtrip(kvm, rt, w, gpu, host, job):
    data = {b: kvm.random_block() for b in gpu}
    for b, d in data.items():
        kvm.write(b, d)
    _store(w, job, gpu, host)
    _until_done(rt, w, {job})
    dst = [15 + i for i in range(len(gpu))]
    _load(w, job + 1, host, dst)
    w.wait({job + 1})
    rt.run_all()
    assert all(kvm.equal(d, data[b]) for d, b in zip(dst, gpu))


def test_a_job_larger_than_ring_max_job_blocks_skips_the_ring():
    """ring_max_job_blocks=3: a 5-block job is copied GPU -> host directly (all 5
    spilled, no ring slot taken) although the ring has room; a 3-block job still goes
    through the ring.  Both restore byte for byte."""
    kvm, rt, w = _rig(ring_max_job_blocks=3)
    _roundtrip(kvm, rt, w, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], job=1)
    assert w.stats.spill_blocks == 5 and w.stats.d2d_blocks == 0
    _roundtrip(kvm, rt, w, [6, 7, 8], [5, 6, 7], job=3)
    assert w.stats.spill_blocks == 5 and w.stats.d2d_blocks == 3


def test_without_a_bound_the_same_job_uses_the_ring():
    kvm, rt, w = _rig()
    _roundtrip(kvm, rt, w, [1, 2, 3, 4, 5], [0, 1, 2, 3, 4], job=1)
    assert w.stats.spill_blocks == 0 and w.stats.d2d_blocks == 5


@pytest.mark.parametrize("prio,high", [("high", True), ("normal", False)])
def test_gather_priority_sets_the_gather_stream(prio, high):
    _, rt, _ = _rig(gather_priority=prio, gather_stream="own")
    seen = rt.made
    assert seen[0] is high and not any(seen[1:])  # gather first; drain and load normal
    _, rt, _ = _rig(gather_priority=prio)  # the default: the gather on the compute stream
    assert rt.made == [False, False]  # drain and load only, at normal priority


def test_a_gather_priority_without_a_gather_stream_is_said_not_to_apply(caplog):
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        _rig(gather_priority="normal", gather_stream="own")
        assert "not applied" not in caplog.text
        _rig(gather_priority="normal")
    assert "gather_priority='normal' not applied" in caplog.text
    assert "gather_stream='compute'" in caplog.text


@pytest.mark.parametrize("kib,max_job,api,msg", [
    (-1, 0, "raw", "drain_chunk_kib must be >= 0"),
    (0.01, 0, "raw", "multiple of 16 bytes"),
    (128, 0, "torch", "needs issue_api='raw'"),
    (0, 2.5, "raw", "whole number"),
    (0, -1, "raw", "whole number"),
])
def test_bad_ring_shape_options_are_refused(kib, max_job, api, msg):
    with pytest.raises(ValueError, match=msg):
        check_ring_shape(kib, max_job, api)


def test_good_ring_shape_options_pass():
    assert check_ring_shape(128, 4, "raw") == (131072, 4)
    assert check_ring_shape(0, 0, "torch") == (0, 0)


@pytest.mark.parametrize("host_layout", ["slot", "tensor"])
@pytest.mark.parametrize("overflow,completion,seed", [("direct", "read", 51),
                                                      ("defer", "host", 52)])
def test_random_ops_with_every_ring_shape_option(host_layout, overflow, completion, seed):
    """The worker with the drain cut into 4 KiB copies, jobs of more than 3 blocks kept off
    the ring and the gather at normal priority, under the randomized harness with random
    stream interleavings: every restored block byte-identical to the block stored, and
    both paths (ring and direct) taken."""
    r = run_random_ops(seed, 5000, overflow=overflow, completion=completion,
                       host_layout=host_layout, issue_api="raw", worker_kw=RING_SHAPE_OPTIONS)
    assert r.restored_blocks > 100 and r.verified_blocks > 0
    assert took_ring_and_direct_paths(r.worker_stats)


def test_chunked_drain_mutant_is_caught():
    """A chunking that drops the last piece of every copy corrupts restored blocks, and
    the harness says so (the test above can fail)."""
    from ion_vllm.kv_tier.testing import Corruption
    import ion_vllm.kv_tier.raw_issue as ri

    orig = ri.chunked

    def short(copies, chunk):
        d, s, z = orig(copies, chunk)
        return d[:-1], s[:-1], z[:-1]

    ri.chunked = short
    try:
        with pytest.raises((Corruption, AssertionError)):
            run_random_ops(53, 3000, issue_api="raw", worker_kw={"drain_chunk_bytes": 4096})
    finally:
        ri.chunked = orig


def test_the_spec_reads_the_options_and_refuses_bad_ones():
    """kv_connector_extra_config keys reach the spec as checked values (strings as JSON
    may hand them over); a drain chunk on the torch issue path is refused at spec time,
    before any engine starts."""
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from tests.test_kv_tier_spec import _cfg

    base = {"cpu_bytes_to_use": 64 << 20}
    s = IonKVTierSpec(_cfg({**base, "drain_chunk_kib": "128", "ring_max_job_blocks": "4",
                            "gather_priority": "normal"}))
    assert (s.drain_chunk_bytes, s.ring_max_job_blocks, s.gather_priority) == \
        (131072, 4, "normal")
    d = IonKVTierSpec(_cfg(base))
    assert (d.drain_chunk_bytes, d.ring_max_job_blocks, d.gather_priority) == (0, 0, "high")
    with pytest.raises(ValueError, match="needs issue_api='raw'"):
        IonKVTierSpec(_cfg({**base, "drain_chunk_kib": 128, "issue_api": "torch"}))
    with pytest.raises(ValueError, match="gather_priority"):
        IonKVTierSpec(_cfg({**base, "gather_priority": "urgent"}))


def test_a_drain_chunk_without_the_raw_path_is_said_not_to_apply(monkeypatch, caplog):
    """When the raw path cannot be built, the chunked drain (a raw-path option) is not
    applied, the log says so, and every block still round-trips."""
    import logging

    from ion_vllm.kv_tier import worker as W

    def no_library():
        raise OSError("libcudart.so: cannot open shared object file")

    monkeypatch.setattr(W, "HostMemmove", no_library)
    with caplog.at_level(logging.WARNING, logger="ion_vllm.kv_tier.worker"):
        r = run_random_ops(6, 800, issue_api="raw", worker_kw={"drain_chunk_bytes": 4096})
    assert "not applied: drain_chunk_kib" in caplog.text
    assert r.restored_blocks > 0
