"""IonKVTierSpec: vLLM OffloadingSpec for the Ion pinned-host KV tier.

Selected with the standard OffloadingConnector:
  --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
     "kv_connector_extra_config":{"spec_name":"IonKVTier","cpu_bytes_to_use":<bytes>}}'
(or ``--kv-offloading-size <GiB>`` which fills in OffloadingConnector and
``cpu_bytes_to_use``, plus ``--kv-transfer-config
'{"kv_connector_extra_config":{"spec_name":"IonKVTier"}}'``).

kv_connector_extra_config keys:
  cpu_bytes_to_use | host_gib   host pool byte budget (all TP ranks together)
  ring_mib                      HBM staging ring per worker (default 256; 0: no ring,
                                every block copied GPU -> host directly, which needs
                                ring_overflow "direct")
  max_inflight_mib              writeback window per worker (default: the larger of
                                4 x ring and min(4 GiB, a quarter of the worker's
                                share of the host pool); see default_window_bytes
  offload_prompt_only           default False here: every full block is stored,
                                decode blocks included
  copier                        "auto" | "batch" | "torch"
  ring_overflow                 "direct" (default) | "defer": what a store does with
                                the blocks the ring has no room for (see worker.py)
  store_completion              "read" (default) | "host": report a store finished
                                once its GPU source blocks were read, or once its
                                bytes are in host memory (see worker.py)
  host_layout                   "slot" (default) | "tensor": one host row per block,
                                or one host region per KV tensor, in which a run of
                                consecutive blocks is one copy (see worker.py)
  ring_gather                   "auto" (default) | "kernel" | "copier": GPU -> ring
                                copies by one Triton launch on the SMs, or by the
                                copier (copy-engine descriptors; see page_gather.py)
  load_copy                     "copier" (default) | "auto" | "kernel": host -> GPU
                                loads by the copier (copy engines, where a load holds
                                up the forward pass's own input copies), or by a few
                                Triton programs on the SMs reading the pinned pool
                                ("auto": on CUDA with a pinned pool; see page_gather.py
                                and worker.py, "One compute stream", for why the copy
                                engines are the default since the thirty-first session)
  issue_at                      "submit" (default) | "finish": issue a submitted
                                transfer's GPU work inside the submit call, before the
                                step's forward pass is enqueued, or at the worker's next
                                get_finished, after it (see worker.py, "Issue")
  id_upload                     "pin_memory" (default) | "staged": the copy kernels'
                                block ids reach the GPU through a pinned tensor per
                                launch, or a persistent pinned buffer (page_gather.py)
  issue_api                     "raw" (default) | "torch": issue the copies through
                                explicit stream handles (compiled Triton launchers,
                                cudaMemcpyAsync, persistent id buffers; raw_issue.py),
                                or the same GPU work through PyTorch and Triton's front
                                ends (about 3x the host time a job)
  gather_priority               "high" (default) | "normal": stream priority of the
                                GPU -> ring gather's own stream (gather_stream "own"),
                                above vLLM's compute stream or equal
  drain_chunk_kib               default 0: the ring drain copies a run of ring rows in
                                one copy; > 0 cuts it into copies of at most that many
                                KiB, issued in one batched call (issue_api "raw"; see
                                raw_issue.PointerDrain)
  ring_max_job_blocks           default 0 (no bound): a store job of more blocks than
                                this skips the ring and is copied GPU -> host directly
                                (a spill), as a bulk prompt store; smaller jobs (decode
                                blocks) keep using the ring
  gather_stream                 "compute" (default) | "own" | "drain": the GPU -> ring
                                gather on vLLM's compute stream in line with the
                                forward pass, so that the tier runs no kernel on a
                                stream of its own (worker.py, "One compute stream"),
                                on a stream of its own (at gather_priority), or queued
                                on the drain stream, the stream direct GPU -> host
                                copies use
  gather_ids                    "device" (default) | "host": the gather kernel reads its
                                block ids from a device buffer they are copied into, or
                                from the pinned host buffer directly, so that a ring
                                piece queues no host -> device copy (issue_api "raw")
  store_batch_blocks            default 0 (off): store jobs of fewer blocks than this
                                (decode blocks) are held and issued together, one
                                gather and drain for all, once they hold this many
                                blocks or the oldest has waited store_batch_steps
  store_batch_steps             default 8: engine steps a held store job waits at most
                                (a flush of it by vLLM issues it at once; worker.py)
  host_delay_us, host_delay_at  test-only (default 0, "submit"): extra busy host time
                                per store job, in submit_store or in the next
                                get_finished; a probe of what the tier's host time
                                costs the engine, never for serving (worker.py)
  ring_idle                     test-only (default false): the ring is made (HBM,
                                gather compiled) but no store uses it; every block
                                is copied GPU -> host directly (worker.py)
  verify                        true: block-verification test mode (every stored
                                and restored block fingerprinted on the GPU and
                                compared, see worker.py); absent: the
                                ION_KV_TIER_VERIFY environment variable decides
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.staging_ring import (
    check_gather_ids,
    check_gather_priority,
    check_gather_stream,
    check_host_delay,
    check_host_layout,
    check_id_upload,
    check_issue_api,
    check_issue_at,
    check_load_copy,
    check_overflow,
    check_ring_gather,
    check_ring_idle,
    check_ring_shape,
    check_store_batch,
    check_store_completion,
)
from ion_vllm.kv_tier.stats import add_process_counters, metric_definitions, process_counter_values
from ion_vllm.kv_tier.vllm_guards import install_abort_guard

logger = init_logger(__name__)

DEFAULT_RING_MIB = 256
#: the writeback window (blocks prepared for store whose completion the scheduler has not
#: seen yet) is at least this many rings ...
DEFAULT_WINDOW_RINGS = 4
#: ... and otherwise min(DEFAULT_WINDOW_GIB, DEFAULT_WINDOW_HOST_FRACTION x host pool).
#: The window is counted on the scheduler side, where a store completes one to two engine
#: steps after it was prepared, so it has to hold a few steps of new full blocks.  One
#: chunked-prefill step of 16k tokens fills 256 blocks of 64 tokens (0.9 GiB for a
#: Qwen2.5-7B-sized KV); 4 x a 256 MiB ring (1 GiB) held barely one such step, and the
#: H200 reuse benchmark of 2026-11-29 dropped 3,762 of 7,969 blocks (47%) at that window
#: (bench/results/2026-11-29-h200/session4/kv-tier-bench).  4 GiB is ~80 ms of the
#: 51 GB/s drain measured there, so a window that size only fills when the drain falls
#: far behind, which is what it exists to catch.  Host memory only: HBM use stays the ring.
DEFAULT_WINDOW_GIB = 4.0
DEFAULT_WINDOW_HOST_FRACTION = 0.25


def default_window_bytes(ring_bytes: int, host_bytes_per_worker: int) -> int:
    """Default writeback window of one worker in bytes (see DEFAULT_WINDOW_GIB)."""
    return max(DEFAULT_WINDOW_RINGS * ring_bytes,
               min(int(DEFAULT_WINDOW_GIB * (1 << 30)),
                   int(DEFAULT_WINDOW_HOST_FRACTION * host_bytes_per_worker)))


def host_bytes_from_extra(extra: dict[str, Any]) -> int:
    if extra.get("cpu_bytes_to_use"):
        return int(float(extra["cpu_bytes_to_use"]))
    if extra.get("host_gib"):
        return int(float(extra["host_gib"]) * (1 << 30))
    raise ValueError(
        "Ion KV tier: set the host pool size with --kv-offloading-size <GiB> or "
        "kv_connector_extra_config 'cpu_bytes_to_use' / 'host_gib'"
    )


def parse_flag(v: Any) -> bool | None:
    """A boolean config value (JSON bool, number or string); None when absent."""
    if v is None:
        return None
    if isinstance(v, str):
        t = v.strip().lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(f"Ion KV tier: not a boolean: {v!r}")
    return bool(v)


class IonKVTierSchedulerManager(IonKVTierManager):
    """The manager vLLM's scheduler gets: ``get_stats`` also carries the
    worker-side counters of this process (verify mode; see stats.py)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._process_seen = process_counter_values()

    def get_stats(self):
        s = super().get_stats()
        self._process_seen = add_process_counters(s, self._process_seen)
        return s


class IonKVTierSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions()

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        extra = dict(self.extra_config)
        # Eager writeback of every full block (decode blocks too): that is what
        # lets a preempted request resume from host memory.  vLLM's default
        # (True) only stores prompt blocks.
        self.offload_prompt_only = bool(extra.get("offload_prompt_only", False))
        if self.blocks_per_chunk != 1:
            raise ValueError("Ion KV tier stores one KV block per chunk; "
                             "do not set block_size/blocks_per_chunk")
        self.host_bytes = host_bytes_from_extra(extra)
        self.ring_bytes = int(float(extra.get("ring_mib", DEFAULT_RING_MIB)) * (1 << 20))
        world = max(1, config.parallel.world_size)
        self.worker_block_bytes = config.worker_kv_bytes_per_block
        self.block_bytes = self.worker_block_bytes * world
        self.num_host_blocks = (self.host_bytes // self.block_bytes
                                if self.block_bytes > 0 else 0)
        if extra.get("max_inflight_mib") is not None:
            window_bytes = int(float(extra["max_inflight_mib"]) * (1 << 20))
        else:
            window_bytes = default_window_bytes(self.ring_bytes, self.host_bytes // world)
        self.max_inflight_blocks = (
            max(1, window_bytes // self.worker_block_bytes)
            if self.worker_block_bytes > 0 else 1)
        self.copier = str(extra.get("copier", "auto"))
        self.ring_overflow = check_overflow(str(extra.get("ring_overflow", "direct")),
                                            "ring_overflow")
        if self.ring_bytes < 0:
            raise ValueError("Ion KV tier: ring_mib must be >= 0")
        if self.ring_bytes == 0 and self.ring_overflow != "direct":
            raise ValueError("Ion KV tier: ring_mib 0 (no ring) needs ring_overflow "
                             "'direct': deferred blocks would wait for slots forever")
        self.store_completion = check_store_completion(
            str(extra.get("store_completion", "read")), "store_completion")
        self.host_layout = check_host_layout(str(extra.get("host_layout", "slot")),
                                             "host_layout")
        self.ring_gather = check_ring_gather(str(extra.get("ring_gather", "auto")),
                                             "ring_gather")
        self.load_copy = check_load_copy(str(extra.get("load_copy", "copier")), "load_copy")
        self.issue_at = check_issue_at(str(extra.get("issue_at", "submit")), "issue_at")
        self.id_upload = check_id_upload(str(extra.get("id_upload", "pin_memory")),
                                         "id_upload")
        self.issue_api = check_issue_api(str(extra.get("issue_api", "raw")), "issue_api")
        self.gather_priority = check_gather_priority(
            str(extra.get("gather_priority", "high")), "gather_priority")
        self.drain_chunk_bytes, self.ring_max_job_blocks = check_ring_shape(
            float(extra.get("drain_chunk_kib", 0)), float(extra.get("ring_max_job_blocks", 0)),
            self.issue_api)
        self.gather_stream = check_gather_stream(str(extra.get("gather_stream", "compute")),
                                                 "gather_stream")
        self.gather_ids = check_gather_ids(str(extra.get("gather_ids", "device")),
                                           self.issue_api, "gather_ids")
        self.store_batch_blocks, self.store_batch_steps = check_store_batch(
            float(extra.get("store_batch_blocks", 0)), float(extra.get("store_batch_steps", 8)))
        self.verify = parse_flag(extra.get("verify"))  # None: ION_KV_TIER_VERIFY
        # test-only: the ring made but unused (worker.py, "idle-ring probe")
        self.ring_idle = check_ring_idle(bool(parse_flag(extra.get("ring_idle"))),
                                         self.ring_overflow, self.ring_bytes)
        if self.ring_idle:
            logger.warning("Ion KV tier: ring_idle: the staging ring is allocated but "
                           "unused - a test-only probe, never for serving")
        # test-only: extra host time per store job (worker.py, "host-time probe")
        self.host_delay_us, self.host_delay_at = check_host_delay(
            float(extra.get("host_delay_us", 0)), str(extra.get("host_delay_at", "submit")))
        if self.host_delay_us:
            logger.warning("Ion KV tier: host_delay_us=%g (%s): every store job spends that "
                           "much extra host time - a test-only probe, never for serving",
                           self.host_delay_us, self.host_delay_at)
        self._manager: IonKVTierManager | None = None
        self._worker = None
        logger.info(
            "Ion KV tier: host %.2f GiB = %d blocks of %d B, ring %d MiB/worker, "
            "writeback window %d blocks, prompt_only=%s, ring overflow %s, "
            "store completion %s, host layout %s, ring gather %s, load copy %s, issue at %s, "
            "id upload %s, issue api %s, gather priority %s, drain chunk %d B, "
            "ring max job %d blocks, gather stream %s, gather ids %s, "
            "store batch %d blocks / %d steps",
            self.host_bytes / 2**30, self.num_host_blocks, self.block_bytes,
            self.ring_bytes >> 20, self.max_inflight_blocks, self.offload_prompt_only,
            self.ring_overflow, self.store_completion, self.host_layout, self.ring_gather,
            self.load_copy, self.issue_at, self.id_upload, self.issue_api,
            self.gather_priority, self.drain_chunk_bytes, self.ring_max_job_blocks,
            self.gather_stream, self.gather_ids, self.store_batch_blocks,
            self.store_batch_steps)

    def get_manager(self) -> IonKVTierManager:
        if self._manager is None:
            # scheduler side: vLLM 0.26 crashes on an abort of a preempted request that
            # this spec's store policy reaches (vllm_guards)
            install_abort_guard()
            self._manager = IonKVTierSchedulerManager(
                num_host_blocks=self.num_host_blocks,
                block_bytes=self.block_bytes,
                host_bytes_budget=self.host_bytes,
                max_inflight_blocks=self.max_inflight_blocks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches):
        if self._worker is None:
            from ion_vllm.kv_tier.worker import IonKVTierWorker

            self._worker = IonKVTierWorker(
                kv_caches,
                num_host_blocks=self.num_host_blocks,
                ring_bytes=self.ring_bytes,
                copier=self.copier,
                verify=self.verify,
                overflow=self.ring_overflow,
                completion=self.store_completion,
                host_layout=self.host_layout,
                ring_gather=self.ring_gather,
                load_copy=self.load_copy,
                issue_at=self.issue_at,
                id_upload=self.id_upload,
                host_delay_us=self.host_delay_us,
                host_delay_at=self.host_delay_at,
                issue_api=self.issue_api,
                gather_priority=self.gather_priority,
                drain_chunk_bytes=self.drain_chunk_bytes,
                ring_max_job_blocks=self.ring_max_job_blocks,
                gather_stream=self.gather_stream,
                gather_ids=self.gather_ids,
                store_batch_blocks=self.store_batch_blocks,
                store_batch_steps=self.store_batch_steps,
                ring_idle=self.ring_idle,
            )
            if self._worker.slot_bytes != self.worker_block_bytes:
                logger.warning(
                    "Ion KV tier: worker block is %d B, scheduler assumed %d B",
                    self._worker.slot_bytes, self.worker_block_bytes)
        return self._worker
