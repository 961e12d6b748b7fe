"""Counters of the Ion KV tier and their export through vLLM's offloading metrics.

Scheduler side (``IonKVTierManager``): lookups, hits, loads, stores, drops, evictions,
host-pool usage and the writeback window, reported by ``OffloadingManager.get_stats()``;
vLLM's ``OffloadPromMetrics`` makes one Prometheus metric per entry of
``metric_definitions``.  Worker side (``WorkerStats``, logged every 30 s): vLLM forwards
only a per-job ``TransferResult`` from workers, whose store time is the gather's for a ring
piece; so the worker also adds each stored block's path (ring or spill), its D2H bytes and
device seconds, and the verify counts to the process-wide ``PROCESS_COUNTERS``, whose
growth the spec's manager adds to its ``get_stats()``.  That reaches Prometheus at world
size 1 (worker and scheduler in one process); with TP > 1 only the workers' logs have it.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

PREFIX = "vllm:ion_kv_tier_"


class M:
    """Metric names (Prometheus) the tier emits."""

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
    # worker side (module docstring)
    RING_BLOCKS = PREFIX + "ring_blocks"
    SPILL_BLOCKS = PREFIX + "spill_blocks"
    D2H_BYTES = PREFIX + "d2h_bytes"
    D2H_SECONDS = PREFIX + "d2h_seconds"
    VERIFIED_BLOCKS = PREFIX + "verified_blocks"
    VERIFY_MISMATCH_BLOCKS = PREFIX + "verify_mismatch_blocks"
    FAILED_LOAD_BLOCKS = PREFIX + "failed_load_blocks"


_DOCS = {  # metric -> (gauge?, documentation)
    M.LOOKUP_BLOCKS: (False, "blocks looked up in the host pool."),
    M.LOOKUP_HIT_BLOCKS: (False, "looked-up blocks found in the host pool (ready or being "
                          "written)."),
    M.LOADED_BLOCKS: (False, "blocks restored host->GPU."),
    M.STORED_BLOCKS: (False, "blocks written back GPU->host."),
    M.STORE_DROPPED_BLOCKS: (False, "blocks not written back because the writeback window "
                             "was full (back-off)."),
    M.STORE_NO_SPACE_BLOCKS: (False, "blocks not written back because every host block was "
                              "pinned by in-flight transfers."),
    M.STORE_AFTER_FINISH_BLOCKS: (False, "blocks refused because vLLM offered them for a "
                                  "finished request (the final token's KV was never "
                                  "computed)."),
    M.EVICTED_BLOCKS: (False, "host blocks evicted (LRU)."),
    M.HOST_USED_BYTES: (True, "host bytes holding blocks."),
    M.HOST_USAGE_PERC: (True, "host pool usage (0..1)."),
    M.INFLIGHT_STORE_PERC: (True, "writeback blocks in flight / window size (0..1)."),
    M.RING_BLOCKS: (False, "worker: blocks written back through the HBM staging ring."),
    M.SPILL_BLOCKS: (False, "worker: blocks copied GPU->host directly (ring full or 0 MiB)."),
    M.D2H_BYTES: (False, "worker: bytes copied into host memory (drains and spills)."),
    M.D2H_SECONDS: (False, "worker: device time of those copies (d2h_bytes / d2h_seconds "
                    "= the D2H rate)."),
    M.VERIFIED_BLOCKS: (False, "verify mode: restored blocks whose GPU bytes were "
                        "compared with the fingerprint of their source at store."),
    M.VERIFY_MISMATCH_BLOCKS: (False, "verify mode: restored blocks whose fingerprint "
                               "differs from the stored one (or that had none)."),
    M.FAILED_LOAD_BLOCKS: (False, "worker: restored blocks reported to vLLM as invalid "
                           "(copy not issued, source store failed, or verify mismatch)."),
}


def metric_definitions() -> dict[str, Any]:
    """Definitions in the form OffloadingSpec.build_metric_definitions returns."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    return {name: (OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata)(
                documentation="Ion KV tier: " + doc)
            for name, (gauge, doc) in _DOCS.items()}


@dataclass
class ProcessCounters:
    """Worker-side counters of this process, monotonic, summed over the workers living
    here (see the module docstring)."""

    verified_blocks: int = 0
    verify_mismatch_blocks: int = 0
    ring_blocks: int = 0
    spill_blocks: int = 0
    d2h_bytes: int = 0  # bytes written to host memory (ring drains, spills)
    d2h_seconds: float = 0.0  # device time of those copies
    failed_load_blocks: int = 0  # restored blocks reported invalid

    def snapshot(self) -> "ProcessCounters":
        return dataclasses.replace(self)


PROCESS_COUNTERS = ProcessCounters()

_PROCESS_METRICS = (
    (M.VERIFIED_BLOCKS, "verified_blocks"),
    (M.VERIFY_MISMATCH_BLOCKS, "verify_mismatch_blocks"),
    (M.RING_BLOCKS, "ring_blocks"),
    (M.SPILL_BLOCKS, "spill_blocks"),
    (M.D2H_BYTES, "d2h_bytes"),
    (M.D2H_SECONDS, "d2h_seconds"),
    (M.FAILED_LOAD_BLOCKS, "failed_load_blocks"),
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
    ``process_counter_values()`` tuple) to an ``OffloadingConnectorStats``; returns the
    new ``seen``."""
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
    dropped_blocks: int = 0  # host copies forgotten after a failed restore


@dataclass
class WorkerStats:
    """Counters of one worker (per process / per TP rank)."""

    store_jobs: int = 0
    load_jobs: int = 0
    d2d_blocks: int = 0  # blocks gathered GPU KV -> staging ring
    d2d_bytes: int = 0
    drained_blocks: int = 0  # blocks copied ring -> pinned host
    drained_bytes: int = 0
    drain_seconds: float = 0.0
    spill_blocks: int = 0  # ring full (or none): GPU -> host directly
    spill_bytes: int = 0
    spill_seconds: float = 0.0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    loads_ordered_after_drain: int = 0  # loads that waited for a pending host write
    ring_slots: int = 0
    ring_used_slots: int = 0
    ring_peak_slots: int = 0
    # verify mode
    fingerprinted_store_blocks: int = 0  # source blocks fingerprinted at store time
    verified_blocks: int = 0  # restored blocks compared with their stored fingerprint
    verify_mismatch_blocks: int = 0  # ... that differed or had no fingerprint
    verify_unknown_blocks: int = 0  # ... of these: no fingerprint for the host block
    # failures (worker.py, "Failures")
    failed_copies: int = 0  # copies that could not be issued
    failed_store_blocks: int = 0  # host blocks left bad by a failed store copy
    failed_load_blocks: int = 0  # restored blocks reported to vLLM as invalid

    @property
    def d2h_gbps(self) -> float:
        t = self.drain_seconds + self.spill_seconds
        b = self.drained_bytes + self.spill_bytes
        return b / t / 1e9 if t > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.loaded_bytes / self.load_seconds / 1e9 if self.load_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["d2h_gbps"] = self.d2h_gbps
        d["h2d_gbps"] = self.h2d_gbps
        return d
