"""IonKVTierSpec: vLLM OffloadingSpec for the Ion pinned-host KV tier.

Selected with vLLM's own OffloadingConnector (docs/kv_tier.md):
  --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
     "kv_connector_extra_config":{"spec_name":"IonKVTier","cpu_bytes_to_use":<bytes>}}'
or ``--kv-offloading-size <GiB>`` (which fills in the connector and ``cpu_bytes_to_use``)
plus ``--kv-transfer-config '{"kv_connector_extra_config":{"spec_name":"IonKVTier"}}'``.
The keys it reads and their validation: ``config.KVTierConfig``.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from ion_vllm.kv_tier.config import KVTierConfig
from ion_vllm.kv_tier.manager import IonKVTierManager
from ion_vllm.kv_tier.stats import add_process_counters, metric_definitions, process_counter_values
from ion_vllm.kv_tier.vllm_guards import install_abort_guard, install_load_error_reporting

logger = init_logger(__name__)


class IonKVTierSchedulerManager(IonKVTierManager):
    """The manager vLLM's scheduler gets: ``get_stats`` also carries the worker-side
    counters of this process (world size 1; see stats.py)."""

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
        self.config = KVTierConfig.from_extra_config(self.extra_config)
        # Every full block is stored, decode blocks included (vLLM's default is prompt
        # blocks only): that is what lets a preempted request resume from host memory.
        self.offload_prompt_only = self.config.offload_prompt_only
        if self.blocks_per_chunk != 1:
            raise ValueError("Ion KV tier stores one KV block per chunk; do not set "
                             "'block_size' / 'blocks_per_chunk' in kv_connector_extra_config")
        self.world = max(1, config.parallel.world_size)
        self.worker_block_bytes = config.worker_kv_bytes_per_block
        self.block_bytes = self.worker_block_bytes * self.world
        self.num_host_blocks = self.config.host_blocks(self.block_bytes)
        if self.block_bytes > 0 and self.num_host_blocks == 0:
            raise ValueError(f"Ion KV tier: 'cpu_bytes_to_use' ({self.config.host_bytes} B) "
                             f"holds no KV block of {self.block_bytes} B")
        ring = self.config.ring_bytes
        if 0 < ring < self.worker_block_bytes:
            raise ValueError(f"Ion KV tier: 'ring_mib' ({self.config.ring_mib}) holds no KV "
                             f"block of {self.worker_block_bytes} B; raise it, or set 0 "
                             "(no ring)")
        self.max_inflight_blocks = self.config.window_blocks(self.worker_block_bytes,
                                                             self.world)
        self._manager: IonKVTierManager | None = None
        self._worker = None
        logger.info("Ion KV tier: host %.2f GiB = %d blocks of %d B, ring %d MiB/worker, "
                    "writeback window %d blocks, prompt_only=%s, verify=%s",
                    self.config.host_bytes / 2**30, self.num_host_blocks, self.block_bytes,
                    ring >> 20, self.max_inflight_blocks, self.offload_prompt_only,
                    self.config.verify)

    def get_manager(self) -> IonKVTierManager:
        if self._manager is None:
            # scheduler side: vLLM 0.26 crashes on an abort of a preempted request that
            # this spec's store policy reaches (vllm_guards)
            install_abort_guard()
            install_load_error_reporting()
            self._manager = IonKVTierSchedulerManager.from_config(
                self.config, self.worker_block_bytes, self.world,
                enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches):
        if self._worker is None:
            from ion_vllm.kv_tier.worker import IonKVTierWorker

            install_load_error_reporting()
            self._worker = IonKVTierWorker(kv_caches, self.config, self.num_host_blocks)
            if self._worker.slot_bytes != self.worker_block_bytes:
                logger.warning("Ion KV tier: worker block is %d B, scheduler assumed %d B",
                               self._worker.slot_bytes, self.worker_block_bytes)
        return self._worker
