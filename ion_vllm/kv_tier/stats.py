"""Counters of the Ion KV tier and their export through vLLM's offloading metrics.

Scheduler side (``IonKVTierManager``): lookups, hits, loads, stores, drops, evictions,
host-pool usage and the in-flight writeback window.  They travel to Prometheus through
``OffloadingManager.get_stats()`` -> ``OffloadingConnectorStats`` -> ``OffloadPromMetrics``,
which creates one metric per entry of ``IonKVTierSpec.build_metric_definitions``.

Worker side (``IonKVTierWorker.stats``, logged every 30 s): ring occupancy, bytes and
seconds per path.  vLLM forwards only the per-job ``TransferResult(transfer_size,
transfer_time)`` from workers to the scheduler: for loads that is the H2D time
(``vllm:kv_offload_load_bytes / _load_time``); for stores it is the time until the job is
reported finished, which for a ring piece is its device-to-device gather, not its drain.
So the worker also adds to the process-wide ``PROCESS_COUNTERS`` the path each stored
block took (ring or spill), its D2H bytes and device seconds, and the verify counts; the
scheduler-side manager of the spec adds their growth to its ``get_stats()``
(``add_process_counters``).  That reaches Prometheus when the worker runs in the
scheduler's process (world size 1); with TP > 1 those counts are only in the workers' logs.
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


def metric_definitions() -> dict[str, Any]:
    """Definitions in the form OffloadingSpec.build_metric_definitions returns."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
    )

    C, G = OffloadingCounterMetadata, OffloadingGaugeMetadata
    return {
        M.LOOKUP_BLOCKS: C(documentation="Ion KV tier: blocks looked up in the host pool."),
        M.LOOKUP_HIT_BLOCKS: C(documentation="Ion KV tier: looked-up blocks found in the "
                               "host pool (ready or being written)."),
        M.LOADED_BLOCKS: C(documentation="Ion KV tier: blocks restored host->GPU."),
        M.STORED_BLOCKS: C(documentation="Ion KV tier: blocks written back GPU->host."),
        M.STORE_DROPPED_BLOCKS: C(documentation="Ion KV tier: blocks not written back "
                                  "because the writeback window was full (back-off)."),
        M.STORE_NO_SPACE_BLOCKS: C(documentation="Ion KV tier: blocks not written back "
                                   "because every host block was pinned by in-flight "
                                   "transfers."),
        M.STORE_AFTER_FINISH_BLOCKS: C(documentation="Ion KV tier: blocks refused because "
                                       "vLLM offered them for a request that had already "
                                       "finished (they hold the final sampled token, whose "
                                       "KV was never computed)."),
        M.EVICTED_BLOCKS: C(documentation="Ion KV tier: host blocks evicted (LRU)."),
        M.HOST_USED_BYTES: G(documentation="Ion KV tier: host bytes holding blocks."),
        M.HOST_USAGE_PERC: G(documentation="Ion KV tier: host pool usage (0..1)."),
        M.INFLIGHT_STORE_PERC: G(documentation="Ion KV tier: writeback blocks in flight / "
                                 "window size (0..1)."),
        M.RING_BLOCKS: C(documentation="Ion KV tier worker: blocks written back through "
                         "the HBM staging ring (GPU->ring->host)."),
        M.SPILL_BLOCKS: C(documentation="Ion KV tier worker: blocks copied GPU->host "
                          "directly because the ring was full (or is 0 MiB)."),
        M.D2H_BYTES: C(documentation="Ion KV tier worker: bytes copied into host memory "
                       "(ring drains and spills)."),
        M.D2H_SECONDS: C(documentation="Ion KV tier worker: device time of those copies "
                         "(d2h_bytes / d2h_seconds = the measured D2H rate)."),
        M.VERIFIED_BLOCKS: C(documentation="Ion KV tier verify mode: restored blocks whose "
                             "GPU bytes were fingerprinted after the host->GPU copy and "
                             "compared with the fingerprint of their GPU source at store."),
        M.VERIFY_MISMATCH_BLOCKS: C(documentation="Ion KV tier verify mode: restored blocks "
                                    "whose fingerprint differs from the stored one (or that "
                                    "had none): corrupted restores."),
    }


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
