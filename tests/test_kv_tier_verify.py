"""Block-verification mode of the Ion KV tier (the ``verify`` key), on CPU.

The worker fingerprints every stored block from its GPU source and every restored block
in its GPU destination and compares them.  These tests drive the worker on CPU tensors
(SimRuntime streams) through the ring and the spill paths, and prove the check can fail:
one flipped host byte, swapped rows, a stale (overwritten) slot and a never-stored slot
are all reported.  They also cover the export (worker -> scheduler-side stats ->
Prometheus) and the verdict logic of scripts/kv_tier_preempt_check.py.
"""

import logging
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_offload.base import GPULoadStoreSpec

from script_loader import SCRIPTS, load_script

from kv_tier_harness import KVModel, make_worker, run_random_ops

from ion_vllm.bench.offload_configs import prometheus_sums
from ion_vllm.kv_tier.copies import TorchCopier
from ion_vllm.kv_tier.manager import IonHostSpec
from ion_vllm.kv_tier.runtime import SimRuntime
from ion_vllm.kv_tier.stats import M, PROCESS_COUNTERS, metric_definitions
from ion_vllm.kv_tier.verify import BlockFingerprinter
from ion_vllm.kv_tier.worker import IonKVTierWorker

VLOG = "ion_vllm.kv_tier.verify"

preempt = load_script("kv_tier_preempt_check.py", "kv_tier_preempt_verify_script")


# ---- helpers ----------------------------------------------------------------
class Rig:
    """A worker over a KVModel (2 layers, ION or K/V-first layout) on CPU."""

    def __init__(self, ring_slots=8, host_blocks=16, num_gpu=24, eager=False,
                 layout="ion", verify=True, worker_cls=IonKVTierWorker, seed=0):
        self.kvm = KVModel(layout, num_gpu, seed=seed)
        self.slot = sum(c.page_size_bytes for c in self.kvm.canonical.tensors)
        self.rt = SimRuntime(eager=eager)
        self.w = make_worker(self.kvm.canonical, host_blocks, ring_slots * self.slot,
                             runtime=self.rt, worker_cls=worker_cls, verify=verify)
        self.truth = {}  # gpu block -> data written there
        self.job = 0
        self.done = set()  # job ids reported by get_finished

    def fill(self, gpu):
        for b in gpu:
            self.truth[b] = self.kvm.random_block()
            self.kvm.write(b, self.truth[b])

    def store(self, gpu, host):
        self.job += 1
        self.w.submit_store(self.job, GPULoadStoreSpec(list(gpu), [len(gpu)], [0]),
                            IonHostSpec(list(host)))
        return self.job

    def load(self, host, gpu):
        self.job += 1
        for b in gpu:
            self.kvm.scrub(b)
        self.w.submit_load(self.job, IonHostSpec(list(host)),
                           GPULoadStoreSpec(list(gpu), [len(gpu)], [0]))
        return self.job

    def finish(self, *jobs):
        want = set(jobs)
        for _ in range(100):
            self.rt.run_all()
            self.done |= {r.job_id for r in self.w.get_finished()}
            if want <= self.done:
                return
        raise AssertionError(f"jobs {want - self.done} never finished")

    def roundtrip(self, gpu, host, dst):
        self.fill(gpu)
        self.finish(self.store(gpu, host))
        self.finish(self.load(host, dst))

    @property
    def st(self):
        return self.w.stats


# ---- the fingerprint ----------------------------------------------------------
def test_fingerprint_catches_every_single_byte_flip_and_word_swap():
    fpr = BlockFingerprinter([96, 160], [0, 96])
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(-128, 128, (3, 256), generator=g, dtype=torch.int8)
    base = BlockFingerprinter.to_ints(fpr.slots(rows))
    assert len(set(base)) == 3 and base == BlockFingerprinter.to_ints(fpr.slots(rows.clone()))
    for pos in range(256):  # every byte position, a random nonzero xor
        r = rows.clone()
        r[1, pos] ^= int(torch.randint(1, 128, (1,), generator=g))
        got = BlockFingerprinter.to_ints(fpr.slots(r))
        assert got[1] != base[1] and got[0] == base[0] and got[2] == base[2], pos
    rng = random.Random(1)
    for _ in range(200):  # swap two different 16-bit words, or two 16-byte rows
        r = rows.clone()
        w = r[2].view(torch.int16)
        i, j = rng.sample(range(128), 2)
        if w[i] == w[j]:
            continue
        w[i], w[j] = w[j].clone(), w[i].clone()
        assert BlockFingerprinter.to_ints(fpr.slots(r))[2] != base[2]
    r = rows.clone()
    r[0, 16:32], r[0, 64:80] = rows[0, 64:80], rows[0, 16:32]
    assert BlockFingerprinter.to_ints(fpr.slots(r))[0] != base[0]
    sw = rows[[1, 0, 2]]  # whole blocks swapped: each block's own value moves with it
    assert BlockFingerprinter.to_ints(fpr.slots(sw)) == [base[1], base[0], base[2]]


def test_fingerprint_parts_equal_whole_slot_and_odd_sizes():
    """GPU side: one row per canonical tensor at its slot offset; host side: the whole
    slot.  The same value, also with byte words (odd page size) and extreme bytes."""
    for pages in ([96, 160], [7, 13, 4]):
        offs = [sum(pages[:i]) for i in range(len(pages))]
        fpr = BlockFingerprinter(pages, offs)
        assert fpr.word == (2 if pages == [96, 160] else 1)
        rows = torch.randint(-128, 128, (5, sum(pages)), dtype=torch.int8)
        rows[0] = 127
        rows[1] = -128
        acc = sum(fpr.part(rows[:, o:o + n], o) for o, n in zip(offs, pages))
        assert torch.equal(fpr.finish(acc), fpr.slots(rows))
    fpr = BlockFingerprinter([4, 4], [0, 4])
    assert BlockFingerprinter.to_ints(fpr.slots(torch.zeros(1, 8, dtype=torch.int8))) != \
        BlockFingerprinter.to_ints(fpr.slots(torch.full((1, 8), -128, dtype=torch.int8)))


def test_fingerprint_chunking_is_exact(monkeypatch):
    fpr = BlockFingerprinter([512], [0])
    rows = torch.randint(-128, 128, (9, 512), dtype=torch.int8)
    whole = fpr.slots(rows)
    monkeypatch.setattr(BlockFingerprinter, "CHUNK_BYTES", 8 * 256 * 2)  # 2 rows a chunk
    assert torch.equal(fpr.slots(rows), whole)


# ---- round trips: ring and spill ----------------------------------------------
@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_ring_roundtrip_verifies_every_block(layout):
    r = Rig(layout=layout)
    r.roundtrip([3, 4, 9, 1], [0, 1, 2, 7], [10, 11, 12, 13])
    assert r.st.d2d_blocks == 4 and r.st.spill_blocks == 0
    assert r.st.fingerprinted_store_blocks == 4
    assert r.st.verified_blocks == 4 and r.st.verify_mismatch_blocks == 0
    for src, dst in zip([3, 4, 9, 1], [10, 11, 12, 13]):
        assert r.kvm.equal(dst, r.truth[src])


def test_spill_roundtrip_verifies_every_block():
    """A 1-slot ring takes one block, the other three go GPU -> host at submit."""
    r = Rig(ring_slots=1)
    gpu, host = [5, 6, 7, 8], [3, 4, 5, 6]
    r.fill(gpu)
    j = r.store(gpu, host)
    assert r.st.spill_blocks == 3 and r.st.d2d_blocks == 1
    r.w.wait({j})
    for b in gpu:  # vLLM may reuse the source blocks now: the copies have read them
        r.kvm.scrub(b)
    r.finish(j)
    r.finish(r.load(host, [0, 1, 2, 3]))
    assert r.st.verified_blocks == 4 and r.st.verify_mismatch_blocks == 0
    assert r.st.fingerprinted_store_blocks == 4
    for src, dst in zip(gpu, [0, 1, 2, 3]):
        assert r.kvm.equal(dst, r.truth[src])


def test_store_fingerprint_taken_before_source_reuse_on_ring_path():
    r = Rig()
    gpu = [2, 3]
    r.fill(gpu)
    j = r.store(gpu, [8, 9])
    r.w.wait({j})  # only the D2D read (and the fingerprint before it) is done
    for b in gpu:
        r.kvm.scrub(b)
    r.finish(j)
    r.finish(r.load([8, 9], [4, 5]))
    assert r.st.verified_blocks == 2 and r.st.verify_mismatch_blocks == 0


@pytest.mark.parametrize("layout", ["ion", "kv_first"])
def test_random_ops_with_verify_all_paths(layout):
    res = run_random_ops(31, 3000, layout=layout, verify=True)
    ws = res.worker_stats
    assert ws["spill_blocks"] > 0 and ws["d2d_blocks"] > 0
    assert ws["verified_blocks"] == res.restored_blocks > 100
    assert ws["verify_mismatch_blocks"] == 0 and ws["verify_unknown_blocks"] == 0


# ---- the check fails when it must ----------------------------------------------
@pytest.mark.parametrize("path", ["ring", "spill"])
@pytest.mark.parametrize("where", ["first", "last", "layer1"])
def test_one_corrupted_host_byte_is_detected(path, where, caplog):
    r = Rig(ring_slots=8 if path == "ring" else 1)
    gpu, host = [5, 6, 7], [2, 3, 4]
    r.fill(gpu)
    j = r.store(gpu, host)
    if path == "spill":
        assert r.st.spill_blocks == 2
    r.finish(j)
    col = {"first": 0, "last": r.slot - 1, "layer1": r.w.offsets[1] + 37}[where]
    r.w.host[3, col] ^= 0x01  # one bit of one byte of host block 3
    with caplog.at_level(logging.ERROR, logger=VLOG):
        r.finish(r.load(host, [10, 11, 12]))
    assert r.st.verified_blocks == 3 and r.st.verify_mismatch_blocks == 1
    msgs = [m for m in caplog.messages if "MISMATCH" in m]
    assert len(msgs) == 1 and "host block 3" in msgs[0] and "GPU block 11" in msgs[0]


class _FlipOnLoad(TorchCopier):
    def to_gpu(self, host, group, host_ids, gpu_ids):
        super().to_gpu(host, group, host_ids, gpu_ids)
        self.tensors[0][int(gpu_ids[-1]), 3] ^= 0x40


class _FlipOnLoadWorker(IonKVTierWorker):
    @staticmethod
    def _copier_cls(is_cuda):
        return _FlipOnLoad  # loads through the corrupting copier


def test_corruption_in_the_h2d_copy_is_detected():
    r = Rig(worker_cls=_FlipOnLoadWorker)
    r.roundtrip([1, 2], [0, 1], [3, 4])
    assert r.st.verified_blocks == 2 and r.st.verify_mismatch_blocks == 1


def test_swapped_rows_and_swapped_blocks_are_detected():
    r = Rig()
    r.fill([1, 2, 3])
    r.finish(r.store([1, 2, 3], [0, 1, 2]))
    h = r.w.host
    h[[0, 1]] = h[[1, 0]].clone()  # two host blocks swapped
    h[2, 0:16], h[2, 64:80] = h[2, 64:80].clone(), h[2, 0:16].clone()  # rows in a block
    r.finish(r.load([0, 1, 2], [5, 6, 7]))
    assert r.st.verified_blocks == 3 and r.st.verify_mismatch_blocks == 3


def test_overwritten_slot_replaces_its_fingerprint_and_stale_bytes_fail():
    r = Rig()
    r.fill([1])
    r.finish(r.store([1], [4]))
    old = r.w.host[4].clone()
    r.fill([2])
    r.finish(r.store([2], [4]))  # host block 4 rewritten (evicted, then reused)
    r.finish(r.load([4], [7]))
    assert r.kvm.equal(7, r.truth[2])
    assert r.st.verified_blocks == 1 and r.st.verify_mismatch_blocks == 0
    r.w.host[4] = old  # as if the second write had been lost
    r.finish(r.load([4], [8]))
    assert r.st.verified_blocks == 2 and r.st.verify_mismatch_blocks == 1
    assert len(r.w.verifier.by_host) == 1  # one entry per host block, never more


def test_load_of_a_never_stored_host_block_is_a_mismatch(caplog):
    r = Rig()
    with caplog.at_level(logging.ERROR, logger=VLOG):
        r.finish(r.load([9], [1]))
    assert r.st.verify_mismatch_blocks == 1 and r.st.verify_unknown_blocks == 1
    assert any("host block 9" in m and "no store" in m for m in caplog.messages)


def test_fingerprint_snapshot_is_taken_at_load_submission():
    """A store that rewrites the host block after the load was submitted must not change
    what the load is compared with (the load reads the older content)."""
    r = Rig(eager=True)
    r.fill([1, 2])
    r.finish(r.store([1], [3]))
    r.rt.eager = False
    j = r.load([3], [6])
    r.rt.run_all()  # the load's copy is done, not yet reported
    r.rt.eager = True
    r.w.submit_store(99, GPULoadStoreSpec([2], [1], [0]), IonHostSpec([3]))
    assert j not in r.done
    r.finish(99, j)
    assert r.kvm.equal(6, r.truth[1])
    assert r.st.verified_blocks == 1 and r.st.verify_mismatch_blocks == 0


# ---- switching it on -------------------------------------------------------------
def test_off_by_default_and_the_spec_key(caplog):
    r = Rig(verify=False)
    assert r.w.verifier is None
    r.roundtrip([1], [0], [2])
    assert r.st.verified_blocks == 0 and r.st.fingerprinted_store_blocks == 0
    with caplog.at_level(logging.WARNING, logger=VLOG):
        assert Rig(verify=True).w.verifier is not None
    assert sum("verify mode on" in m for m in caplog.messages) == 1

    from test_kv_tier_spec import _cfg

    from ion_vllm.kv_tier.spec import IonKVTierSpec

    kvm = KVModel("ion", 8)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    for extra, want in (({}, False), ({"verify": True}, True), ({"verify": "false"}, False)):
        spec = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 * slot, "ring_mib": 0.01, **extra},
                                  block_bytes=slot))
        assert (spec.get_worker(kvm.canonical).verifier is not None) is want


# ---- export ----------------------------------------------------------------------
def test_metric_names_and_export_to_prometheus():
    """Worker counts -> the spec's manager get_stats -> vLLM's OffloadPromMetrics ->
    the registry read by prometheus_sums (what the GPU scripts record)."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    from test_kv_tier_spec import _cfg

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    from ion_vllm.kv_tier import SPEC_NAME, register_kv_tier
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    assert M.VERIFIED_BLOCKS == "vllm:ion_kv_tier_verified_blocks"
    assert M.VERIFY_MISMATCH_BLOCKS == "vllm:ion_kv_tier_verify_mismatch_blocks"
    defs = metric_definitions()
    assert M.VERIFIED_BLOCKS in defs and M.VERIFY_MISMATCH_BLOCKS in defs
    assert preempt.M_VERIFIED == M.VERIFIED_BLOCKS
    assert preempt.M_VERIFY_MISMATCH == M.VERIFY_MISMATCH_BLOCKS

    register_kv_tier()
    kvm = KVModel("ion", 8)
    slot = sum(c.page_size_bytes for c in kvm.canonical.tensors)
    spec = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 * slot, "ring_mib": 0.01,
                               "verify": True}, block_bytes=slot))
    mgr = spec.get_manager()
    mgr.get_stats()
    w = spec.get_worker(kvm.canonical)  # on a CPU: synchronous simulated streams
    before = PROCESS_COUNTERS.snapshot()
    for b in (0, 1, 2):
        kvm.write(b, kvm.random_block())
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2], [3], [0]), IonHostSpec([0, 1, 2]))
    w.get_finished()
    w.host[1, 5] ^= 1
    w.submit_load(2, IonHostSpec([0, 1, 2]), GPULoadStoreSpec([4, 5, 6], [3], [0]))
    assert [x.job_id for x in w.get_finished()] == [2]
    assert PROCESS_COUNTERS.verified_blocks - before.verified_blocks == 3
    red = mgr.get_stats().reduce()
    assert red[M.VERIFIED_BLOCKS] == 3 and red[M.VERIFY_MISMATCH_BLOCKS] == 1
    assert all(k in IonKVTierSpec.build_metric_definitions({}) for k in red)
    assert M.VERIFIED_BLOCKS not in mgr.get_stats().reduce()  # deltas

    created = []

    def tracked(cls):
        def make(**kw):
            m = cls(**kw)
            created.append(m)
            return m
        return make

    vc = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"spec_name": SPEC_NAME}))
    try:
        prom = OffloadPromMetrics(vc, {Counter: tracked(Counter), Gauge: tracked(Gauge),
                                       Histogram: tracked(Histogram)},
                                  ["model_name", "engine"], {0: ["m", "0"]})
        st = spec.get_manager().get_stats()
        st.increase_counter(M.VERIFIED_BLOCKS, 5)
        st.increase_counter(M.VERIFY_MISMATCH_BLOCKS, 2)
        prom.observe(st.data, 0)
        sums = prometheus_sums()
        assert sums[M.VERIFIED_BLOCKS] == 5.0 and sums[M.VERIFY_MISMATCH_BLOCKS] == 2.0
    finally:
        for m in created:
            REGISTRY.unregister(m)


# ---- the GPU script's verdicts -----------------------------------------------------
REF = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
OK_METRICS = {"vllm:num_preemptions": 3.0, "vllm:kv_offload_load_bytes": 1024.0}


def _m(verified, mism):
    return {**OK_METRICS, M.VERIFIED_BLOCKS: verified, M.VERIFY_MISMATCH_BLOCKS: mism}


def test_first_diff():
    assert preempt.first_diff([1, 2], [1, 2]) is None
    assert preempt.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert preempt.first_diff([1, 2, 3], [1, 2]) == 2
    assert preempt.first_diffs(REF, [REF[0], [5, 6, 0, 0], [0, 9, 9, 9]]) == {1: 2, 2: 0}


def test_verdict_strict_token_identity():
    rep, _, code = preempt.evaluate(REF, REF, OK_METRICS, None, verify=False)
    assert rep["pass"] and code == 0 and rep["blocks_pass"] is None
    assert rep["mismatched_requests"] == [] and rep["tier_first_diff_token"] == {}
    tier = [REF[0], [5, 6, 7, 0], REF[2]]
    rep, _, code = preempt.evaluate(REF, tier, OK_METRICS, None, verify=False)
    assert not rep["pass"] and code == 1 and rep["tier_first_diff_token"] == {"1": 3}
    rep, _, code = preempt.evaluate(REF, REF, {"vllm:kv_offload_load_bytes": 1.0}, None,
                                    verify=False)
    assert not rep["pass"] and code == 1  # no preemption
    ctl = [[1, 2, 0, 0], REF[1], REF[2]]  # without --verify a noisy control fails the run
    rep, _, code = preempt.evaluate(REF, tier, OK_METRICS, ctl, verify=False)
    assert code == 1 and rep["control_first_diff_token"] == {"0": 2}


def test_verdict_with_verify():
    tier = [REF[0], [5, 6, 7, 0], REF[2]]
    ctl = [[1, 2, 0, 0], REF[1], REF[2]]
    # tokens differ, the control differs too, every restored block byte-identical: pass
    rep, msgs, code = preempt.evaluate(REF, tier, _m(40.0, 0.0), ctl, verify=True)
    assert code == 0 and rep["blocks_pass"] and not rep["pass"]
    assert rep["verified_blocks"] == 40.0 and rep["verify_mismatch_blocks"] == 0.0
    assert rep["control_mismatched_requests"] == [0]
    assert any(m.startswith("BLOCKS PASS") for m in msgs)
    assert any(m.startswith("TOKENS FAIL") for m in msgs)
    # one corrupted block fails it, whatever the tokens say
    assert preempt.evaluate(REF, tier, _m(40.0, 1.0), ctl, verify=True)[2] == 1
    assert preempt.evaluate(REF, REF, _m(40.0, 1.0), None, verify=True)[2] == 1
    # nothing verified: no evidence
    rep, _, code = preempt.evaluate(REF, REF, _m(0.0, 0.0), None, verify=True)
    assert code == 1 and rep["blocks_pass"] is False
    rep, _, code = preempt.evaluate(REF, REF, OK_METRICS, None, verify=True)
    assert code == 1
    # the control matches: token comparison is meaningful, the tier run fails
    assert preempt.evaluate(REF, tier, _m(40.0, 0.0), REF, verify=True)[2] == 1
    assert preempt.evaluate(REF, tier, _m(40.0, 0.0), None, verify=True)[2] == 1
    # no preemption: not the scenario under test
    no_pre = {**_m(40.0, 0.0), "vllm:num_preemptions": 0.0}
    assert preempt.evaluate(REF, tier, no_pre, ctl, verify=True)[2] == 1
    # all identical and verified
    rep, _, code = preempt.evaluate(REF, REF, _m(40.0, 0.0), None, verify=True)
    assert code == 0 and rep["pass"] and rep["blocks_pass"]


def test_only_the_verify_run_asks_the_tier_to_verify():
    """--verify reaches the tier child as the ``verify`` key (no environment variable), and
    a run without it has no such key."""
    base = {"host_gib": 0.5, "ring_mib": 16}
    ext = preempt.offload_config({**base, "verify": True})["kv_connector_extra_config"]
    assert ext["verify"] is True
    assert "verify" not in preempt.offload_config(base)["kv_connector_extra_config"]


def test_verify_needs_the_ion_spec():
    r = subprocess.run([sys.executable, f"{SCRIPTS}/kv_tier_preempt_check.py", "/nonexistent",
                        "--verify", "--spec", "native"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 2 and "--verify needs --spec ion" in r.stderr


# ---- failures are reported to vLLM as invalid blocks (worker.py, "Failures") ---------
def test_a_verify_mismatch_is_reported_as_an_invalid_block():
    r = Rig(worker_cls=_FlipOnLoadWorker)
    r.roundtrip([1, 2], [0, 1], [3, 4])
    assert r.w.take_invalid_block_ids() == {4}  # the flipped block only
    assert r.w.take_invalid_block_ids() == set()  # reported once
    assert r.st.failed_load_blocks == 1


class _RaiseOn(TorchCopier):
    """A copier whose ``op`` raises (a copy that cannot be issued) while ``armed``."""

    op, armed = "to_gpu", True

    def _maybe_raise(self, op):
        if _RaiseOn.armed and op == _RaiseOn.op:
            raise RuntimeError(f"injected: {op} cannot be issued")

    def to_gpu(self, *a):
        self._maybe_raise("to_gpu")
        super().to_gpu(*a)

    def to_host(self, *a):
        self._maybe_raise("to_host")
        super().to_host(*a)

    def drain(self, *a):
        self._maybe_raise("drain")
        super().drain(*a)


class _RaiseWorker(IonKVTierWorker):
    @staticmethod
    def _copier_cls(is_cuda):
        return _RaiseOn


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_load_copy_that_cannot_be_issued_fails_its_blocks_not_the_engine(verify, caplog):
    _RaiseOn.op, _RaiseOn.armed = "to_gpu", False
    # eager: a launch runs its copy at once, as CUDA issues it inside rt.launch
    r = Rig(worker_cls=_RaiseWorker, verify=verify, eager=True)
    r.fill([1, 2, 3])
    r.finish(r.store([1, 2, 3], [0, 1, 2]))
    _RaiseOn.armed = True
    with caplog.at_level(logging.ERROR):
        j = r.load([0, 1, 2], [5, 6, 7])  # does not raise into vLLM's engine loop
        r.finish(j)  # the job is reported finished ...
    assert r.w.take_invalid_block_ids() == {5, 6, 7}  # ... and its blocks invalid
    assert r.st.failed_copies == 1 and any("could not be issued" in m
                                           for m in caplog.messages)
    _RaiseOn.armed = False
    r.finish(r.load([0, 1, 2], [8, 9, 10]))  # the host copies are fine: a retry works
    assert r.w.take_invalid_block_ids() == set()
    assert all(r.kvm.equal(d, r.truth[b]) for d, b in zip([8, 9, 10], [1, 2, 3]))


@pytest.mark.parametrize("path", ["ring", "spill"])
def test_a_failed_store_leaves_its_host_blocks_bad_until_stored_again(path):
    _RaiseOn.op, _RaiseOn.armed = ("drain" if path == "ring" else "to_host"), True
    r = Rig(worker_cls=_RaiseWorker, ring_slots=8 if path == "ring" else 0, verify=False,
            eager=True)
    r.fill([1, 2])
    r.finish(r.store([1, 2], [4, 5]))  # reported finished: vLLM's contract has no failure
    assert r.st.failed_store_blocks == 2
    _RaiseOn.armed = False
    r.finish(r.load([4, 5], [6, 7]))
    assert r.w.take_invalid_block_ids() == {6, 7}  # never served as good
    r.finish(r.store([1], [4]))  # stored again: good again
    r.finish(r.load([4, 5], [8, 9]))
    assert r.w.take_invalid_block_ids() == {9}
    assert r.kvm.equal(8, r.truth[1])
