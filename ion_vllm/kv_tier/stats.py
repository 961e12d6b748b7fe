"""Counters of the Ion KV tier and their export through vLLM's offloading metrics.

Scheduler side (``IonKVTierManager``): lookups, hits, loads, stores, drops,
evictions, host-pool usage and the in-flight writeback window (an upper bound
of the HBM staging ring occupancy, mirrored from the scheduler's view).  They
travel to Prometheus through ``OffloadingManager.get_stats()`` ->
``OffloadingConnectorStats`` -> ``OffloadPromMetrics``, which creates one
Prometheus metric per entry returned by ``IonKVTierSpec.build_metric_definitions``.

Worker side (``IonKVTierWorker``): real ring occupancy, D2D / D2H / H2D bytes and
seconds, spilled (ring full at submit, ``overflow="direct"``), deferred and
bypassed blocks.  vLLM forwards only the per-job
``TransferResult(transfer_size, transfer_time)`` from workers to the scheduler;
the worker reports the *D2H drain* time for stores and the *H2D* time for
loads there.  For loads, vLLM's ``vllm:kv_offload_load_bytes / _load_time`` is the
measured H2D rate.  For stores, ``transfer_time`` is the time until the job is
reported finished, which under the default ``completion="read"`` is the D2D time
of a ring piece, not its drain (see worker.py); the D2H rate is therefore
exported by the worker itself: ``vllm:ion_kv_tier_d2h_bytes / _d2h_seconds``
(every ring drain, spill and bypass copy, timed on the device).  The rest of the
worker counters are read from ``worker.stats`` and logged periodically.

The worker also adds the path each stored block took (ring, spill, deferred, bypass)
and its D2H bytes and seconds to ``PROCESS_COUNTERS``, exported the same way as the
verify counters below.

Verify mode (``ION_KV_TIER_VERIFY=1``, see worker.py): the worker fingerprints
every stored and every restored block and counts restored blocks checked
(``verified_blocks``) and those whose bytes differ from what was stored
(``verify_mismatch_blocks``).  vLLM has no worker -> scheduler channel for
arbitrary counters, so the worker also adds them to the process-wide
``PROCESS_COUNTERS``; the scheduler-side manager that ``IonKVTierSpec``
builds adds their growth to its ``get_stats()`` (``add_process_counters``), which
reaches Prometheus as ``vllm:ion_kv_tier_verified_blocks`` /
``vllm:ion_kv_tier_verify_mismatch_blocks``.  That works when the worker runs in
the scheduler's process (world size 1: vLLM's ``uni`` executor, inside the
engine core); with TP > 1 the workers are other processes and their verify
counts are only in their logs (periodic stats line and shutdown summary).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

PREFIX = "vllm:ion_kv_tier_"


class M:
    """Metric names (Prometheus) emitted by the manager."""

    LOOKUP_BLOCKS = PREFIX + "lookup_blocks"
    LOOKUP_HIT_BLOCKS = PREFIX + "lookup_hit_blocks"
    LOADED_BLOCKS = PREFIX + "loaded_blocks"
    STORED_BLOCKS = PREFIX + "stored_blocks"
    STORE_DROPPED_BLOCKS = PREFIX + "store_dropped_blocks"
    STORE_NO_SPACE_BLOCKS = PREFIX + "store_no_space_blocks"
    STORE_AFTER_FINISH_BLOCKS = PREFIX + "store_after_finish_blocks"
    EVICTED_BLOCKS = PREFIX + "evicted_blocks"
    HOST_USED_BYTES = PREFIX + "host_used_bytes"
    HOST_USAGE_PERC = PREFIX + "host_usage_perc"
    INFLIGHT_STORE_PERC = PREFIX + "inflight_store_window_perc"
    # worker side: which path each stored block took (see module docstring)
    RING_BLOCKS = PREFIX + "ring_blocks"
    SPILL_BLOCKS = PREFIX + "spill_blocks"
    DEFERRED_BLOCKS = PREFIX + "deferred_blocks"
    BYPASS_BLOCKS = PREFIX + "bypass_blocks"
    D2H_BYTES = PREFIX + "d2h_bytes"
    D2H_SECONDS = PREFIX + "d2h_seconds"
    # worker side, verify mode only (see module docstring)
    VERIFIED_BLOCKS = PREFIX + "verified_blocks"
    VERIFY_MISMATCH_BLOCKS = PREFIX + "verify_mismatch_blocks"


def prometheus_sums(prefix: str = "vllm:",
                    split_labels: tuple[str, ...] = ("source",)) -> dict[str, float]:
    """This process's vLLM counters and gauges summed over labels, as floats, read from the
    Prometheus registry directly (``LLM.get_metrics()`` truncates counters to int, which
    turns the seconds of ``vllm:kv_offload_*_time`` into 0).  Used by the KV-tier scripts.

    Histograms give ``<name>_sum`` and ``<name>_count`` (e.g. ``vllm:iteration_tokens_total``:
    tokens computed over all engine steps, and the number of steps).  A sample with a label
    in ``split_labels`` is also summed under ``<name>[<value>]`` (e.g.
    ``vllm:prompt_tokens_by_source[local_compute]``)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        out[key] = out.get(key, 0.0) + v

    for fam in REGISTRY.collect():
        if not fam.name.startswith(prefix):
            continue
        for smp in fam.samples:
            if fam.type == "histogram":
                if smp.name in (fam.name + "_sum", fam.name + "_count"):
                    add(smp.name, float(smp.value))
                continue
            if fam.type not in ("counter", "gauge"):
                continue
            if fam.type == "counter" and not smp.name.endswith("_total"):
                continue  # skip *_created
            add(fam.name, float(smp.value))
            for lab in split_labels:
                if lab in smp.labels:
                    add(f"{fam.name}[{smp.labels[lab]}]", float(smp.value))
    return out


def metric_definitions() -> dict[str, Any]:
    """Definitions in the form OffloadingSpec.build_metric_definitions returns."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
    )

    C, G = OffloadingCounterMetadata, OffloadingGaugeMetadata
    return {
        M.LOOKUP_BLOCKS: C(documentation="Ion KV tier: blocks looked up in the host pool."),
        M.LOOKUP_HIT_BLOCKS: C(
            documentation="Ion KV tier: looked-up blocks found in the host pool "
            "(ready or being written)."
        ),
        M.LOADED_BLOCKS: C(documentation="Ion KV tier: blocks restored host->GPU."),
        M.STORED_BLOCKS: C(documentation="Ion KV tier: blocks written back GPU->host."),
        M.STORE_DROPPED_BLOCKS: C(
            documentation="Ion KV tier: blocks not written back because the "
            "writeback window (staging ring backlog) was full (back-off)."
        ),
        M.STORE_NO_SPACE_BLOCKS: C(
            documentation="Ion KV tier: blocks not written back because every "
            "host block was pinned by in-flight transfers."
        ),
        M.STORE_AFTER_FINISH_BLOCKS: C(
            documentation="Ion KV tier: blocks refused because vLLM offered them for "
            "a request that had already finished (they hold the final sampled token, "
            "whose KV was never computed)."
        ),
        M.EVICTED_BLOCKS: C(documentation="Ion KV tier: host blocks evicted (LRU)."),
        M.HOST_USED_BYTES: G(documentation="Ion KV tier: host bytes holding blocks."),
        M.HOST_USAGE_PERC: G(documentation="Ion KV tier: host pool usage (0..1)."),
        M.INFLIGHT_STORE_PERC: G(
            documentation="Ion KV tier: writeback blocks in flight / window size "
            "(0..1); >= ring share means the ring is full and later blocks wait."
        ),
        M.RING_BLOCKS: C(documentation="Ion KV tier worker: blocks written back through "
                         "the HBM staging ring (GPU->ring->host)."),
        M.SPILL_BLOCKS: C(documentation="Ion KV tier worker: blocks copied GPU->host "
                          "directly at submit because the ring was full "
                          "(ring_overflow=direct)."),
        M.DEFERRED_BLOCKS: C(documentation="Ion KV tier worker: blocks that waited for "
                             "ring slots (ring_overflow=defer)."),
        M.BYPASS_BLOCKS: C(documentation="Ion KV tier worker: deferred blocks copied "
                           "GPU->host directly when vLLM flushed their job; the engine "
                           "step waited for that copy."),
        M.D2H_BYTES: C(documentation="Ion KV tier worker: bytes copied into host memory "
                       "(ring drains, spills, bypasses)."),
        M.D2H_SECONDS: C(documentation="Ion KV tier worker: device time of those copies "
                         "(d2h_bytes / d2h_seconds = the measured D2H rate)."),
        M.VERIFIED_BLOCKS: C(
            documentation="Ion KV tier verify mode: restored blocks whose GPU bytes were "
            "fingerprinted after the host->GPU copy and compared with the fingerprint "
            "taken from the GPU source when the host block was stored."
        ),
        M.VERIFY_MISMATCH_BLOCKS: C(
            documentation="Ion KV tier verify mode: restored blocks whose fingerprint "
            "differs from the stored one (or that had none): corrupted restores."
        ),
    }


@dataclass
class ProcessCounters:
    """Worker-side counters of this process, monotonic; summed over the workers
    living here (see the module docstring)."""

    verified_blocks: int = 0
    verify_mismatch_blocks: int = 0
    ring_blocks: int = 0
    spill_blocks: int = 0
    deferred_blocks: int = 0
    bypass_blocks: int = 0
    d2h_bytes: int = 0  # bytes written to host memory (ring drain, spill, bypass)
    d2h_seconds: float = 0.0  # device time of those copies

    def snapshot(self) -> "ProcessCounters":
        return dataclasses.replace(self)


PROCESS_COUNTERS = ProcessCounters()

_PROCESS_METRICS = (
    (M.VERIFIED_BLOCKS, "verified_blocks"),
    (M.VERIFY_MISMATCH_BLOCKS, "verify_mismatch_blocks"),
    (M.RING_BLOCKS, "ring_blocks"),
    (M.SPILL_BLOCKS, "spill_blocks"),
    (M.DEFERRED_BLOCKS, "deferred_blocks"),
    (M.BYPASS_BLOCKS, "bypass_blocks"),
    (M.D2H_BYTES, "d2h_bytes"),
    (M.D2H_SECONDS, "d2h_seconds"),
)


_process_values = operator.attrgetter(*(f for _, f in _PROCESS_METRICS))


def process_counter_values() -> tuple:
    """``PROCESS_COUNTERS``' exported fields as a tuple (a cheap snapshot)."""
    return _process_values(PROCESS_COUNTERS)


def add_counter_growth(stats: Any, metrics, now: tuple, seen: tuple) -> tuple:
    """Add the growth ``now - seen`` of monotonic counters (tuples in the order of
    ``metrics``, pairs (metric, field)) to an ``OffloadingConnectorStats`` as counters,
    metric by metric where it grew; returns ``now`` (the next ``seen``).  Called every
    engine step: when nothing moved (most decode steps) it costs one tuple comparison."""
    if now != seen:
        for (name, _), a, b in zip(metrics, now, seen):
            if a - b > 0:
                stats.increase_counter(name, a - b)
    return now


def add_process_counters(stats: Any, seen: tuple) -> tuple:
    """Add the growth of ``PROCESS_COUNTERS`` since ``seen`` (a
    ``process_counter_values()`` tuple) to an ``OffloadingConnectorStats`` as counters;
    returns the new ``seen``."""
    return add_counter_growth(stats, _PROCESS_METRICS, _process_values(PROCESS_COUNTERS), seen)


@dataclass
class ManagerCounters:
    """Monotonic counters of the scheduler-side manager (never reset)."""

    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    loaded_blocks: int = 0
    stored_blocks: int = 0  # prepare_store accepted
    completed_store_blocks: int = 0
    failed_store_blocks: int = 0
    store_dropped_blocks: int = 0
    store_no_space_blocks: int = 0
    store_after_finish_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class WorkerStats:
    """Counters of one worker (per process / per TP rank)."""

    store_jobs: int = 0
    load_jobs: int = 0
    d2d_blocks: int = 0  # blocks copied GPU KV -> staging ring
    d2d_bytes: int = 0
    drained_blocks: int = 0  # blocks copied ring -> pinned host
    drained_bytes: int = 0
    drain_seconds: float = 0.0
    bypass_blocks: int = 0  # flushed GPU -> host directly (ring full at flush)
    bypass_bytes: int = 0
    bypass_seconds: float = 0.0
    spill_blocks: int = 0  # ring full at submit: GPU -> host directly (overflow="direct")
    spill_bytes: int = 0
    spill_seconds: float = 0.0
    deferred_blocks: int = 0  # blocks that had to wait for ring space
    store_batches: int = 0  # store batching: held jobs issued together as one
    batched_store_jobs: int = 0  # ... the jobs in them
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    loads_ordered_after_drain: int = 0
    ring_slots: int = 0
    ring_used_slots: int = 0
    ring_peak_slots: int = 0
    # verify mode (ION_KV_TIER_VERIFY=1)
    fingerprinted_store_blocks: int = 0  # source blocks fingerprinted at store time
    verified_blocks: int = 0  # restored blocks compared with their stored fingerprint
    verify_mismatch_blocks: int = 0  # ... that differed or had no fingerprint
    verify_unknown_blocks: int = 0  # ... of these: no fingerprint for the host block
    samples: list[int] = field(default_factory=list, repr=False)

    @property
    def d2h_gbps(self) -> float:
        t = self.drain_seconds + self.bypass_seconds + self.spill_seconds
        b = self.drained_bytes + self.bypass_bytes + self.spill_bytes
        return b / t / 1e9 if t > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("samples")
        d["d2h_gbps"] = self.d2h_gbps
        d["h2d_gbps"] = self.h2d_gbps
        return d
