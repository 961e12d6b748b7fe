"""Registration, config plumbing and metrics of the Ion KV tier spec (CPU)."""

import os

import pytest

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from ion_vllm.kv_tier import SPEC_NAME, kv_transfer_config_dict, register_kv_tier


def _cfg(extra, block_bytes=1 << 20, world=1, bpc=1):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=64, layer_names=("l0", "l1")),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="e",
        model=OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=64, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(rank=0, world_size=world, tp_size=world, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          is_parallelism_agnostic=True),
    )


def test_register_idempotent_and_resolvable():
    register_kv_tier()
    register_kv_tier()
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    assert OffloadingSpecFactory.get_spec_cls({"spec_name": SPEC_NAME}) is IonKVTierSpec
    spec = OffloadingSpecFactory.create_spec(_cfg({"spec_name": SPEC_NAME,
                                                   "cpu_bytes_to_use": 10 * (1 << 30)}))
    assert isinstance(spec, IonKVTierSpec)


def test_spec_sizes_and_decode_blocks():
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 100 * (1 << 20) + 5, "ring_mib": 8},
                           block_bytes=1 << 20, world=2))
    assert s.offload_prompt_only is False  # every full block, decode included
    assert s.block_bytes == 2 << 20 and s.num_host_blocks == 50
    assert s.num_host_blocks * s.block_bytes <= s.config.host_bytes
    assert s.max_inflight_blocks == 32  # 4 x 8 MiB ring / 1 MiB per worker block
    m = s.get_manager()
    assert m is s.get_manager() and m.num_host_blocks == 50
    s2 = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 1 << 30, "offload_prompt_only": True}))
    assert s2.offload_prompt_only is True and s2.num_host_blocks == 1024


def test_spec_rejects_multi_block_chunks_and_missing_size():
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    with pytest.raises(ValueError, match="one KV block per chunk"):
        IonKVTierSpec(_cfg({"cpu_bytes_to_use": 1 << 30}, bpc=4))
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        IonKVTierSpec(_cfg({}))
    with pytest.raises(ValueError, match="holds no KV block"):
        IonKVTierSpec(_cfg({"cpu_bytes_to_use": 1000}, block_bytes=1 << 20))
    with pytest.raises(ValueError, match="'ring_mib' .* holds no KV block"):
        IonKVTierSpec(_cfg({"cpu_bytes_to_use": 1 << 30, "ring_mib": 0.5}))


def test_scheduler_side_config_stores_decode_blocks():
    """vLLM's scheduler reads offload_prompt_only from the spec."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        SchedulerOffloadConfig,
    )
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 1 << 30}))
    cfg = SchedulerOffloadConfig(kv_group_configs=(), blocks_per_chunk=s.blocks_per_chunk,
                                 num_workers=1, offload_prompt_only=s.offload_prompt_only)
    assert cfg.offload_prompt_only is False


def test_stats_and_metric_definitions():
    from ion_vllm.kv_tier.manager import IonKVTierManager
    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from ion_vllm.kv_tier.stats import M
    from kv_tier_harness import CTX, key_of

    defs = IonKVTierSpec.build_metric_definitions({})
    m = IonKVTierManager(4, 10, 40, 3)
    out = m.prepare_store([key_of(i) for i in range(5)], CTX)
    assert len(out.keys_to_store) == 3  # window of 3
    m.complete_store(out.keys_to_store, CTX)
    m.lookup(key_of(0), CTX)
    m.lookup(key_of(4), CTX)
    st = m.get_stats()
    red = st.reduce()
    for name in red:
        assert name in defs, name
    assert red[M.STORE_DROPPED_BLOCKS] == 2 and red[M.STORED_BLOCKS] == 3
    assert red[M.LOOKUP_BLOCKS] == 2 and red[M.LOOKUP_HIT_BLOCKS] == 1
    assert red[M.HOST_USED_BYTES] == 30
    # counters are deltas since the last call, and a gauge is sent when its value changed
    # since the last call that sent it: a call after which nothing moved is empty, which
    # vLLM's scheduler drops (no payload on a quiet decode step; Prometheus keeps the value)
    assert m.get_stats().is_empty()
    m.lookup(key_of(1), CTX)
    red2 = m.get_stats().reduce()
    assert red2 == {M.LOOKUP_BLOCKS: 1, M.LOOKUP_HIT_BLOCKS: 1}
    out = m.prepare_store([key_of(5)], CTX)
    red3 = m.get_stats().reduce()
    assert M.STORED_BLOCKS not in red3  # not stored yet, but its host block is taken
    assert red3[M.HOST_USED_BYTES] == 40
    assert red3[M.INFLIGHT_STORE_PERC] == pytest.approx(1 / 3)  # in flight: 1 of 3
    m.complete_store(out.keys_to_store, CTX)
    red4 = m.get_stats().reduce()  # used bytes did not move: not sent again
    assert red4 == {M.STORED_BLOCKS: 1, M.INFLIGHT_STORE_PERC: 0.0}


def test_kv_transfer_config_cli_form_parses():
    from vllm.config import KVTransferConfig

    d = kv_transfer_config_dict(2.5, ring_mib=64)
    c = KVTransferConfig(**d)
    assert c.kv_connector == "OffloadingConnector"
    assert c.kv_load_failure_policy == "recompute"
    assert c.kv_connector_extra_config["spec_name"] == SPEC_NAME
    assert c.kv_connector_extra_config["cpu_bytes_to_use"] == int(2.5 * (1 << 30))


def test_env_switch(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    import ion_vllm.kv_tier as kt

    monkeypatch.setenv(kt.ENV_GB, "3")
    orig = EngineArgs.create_engine_config
    seen = {}

    def fake(self, *a, **k):
        seen["cfg"] = self.kv_transfer_config
        return None

    monkeypatch.setattr(EngineArgs, "create_engine_config", fake)
    monkeypatch.setattr(kt, "_env_patched", False)
    kt.register_kv_tier()
    args = EngineArgs.__new__(EngineArgs)
    args.kv_transfer_config = None
    args.kv_offloading_size = None
    EngineArgs.create_engine_config(args)
    assert seen["cfg"].kv_connector_extra_config["spec_name"] == SPEC_NAME
    assert seen["cfg"].kv_connector_extra_config["cpu_bytes_to_use"] == 3 << 30
    monkeypatch.setattr(EngineArgs, "create_engine_config", orig)
    assert os.environ[kt.ENV_GB] == "3"


def test_default_writeback_window_covers_several_prefill_steps():
    """The default window: 4 rings at least, else min(4 GiB, a quarter of the worker's host
    pool).  With the H200 reuse benchmark's setup (Qwen2.5-7B KV: 3,670,016 B per 64-token
    block, 24 GiB host, 256 MiB ring) it holds more than 4 steps of 16k-token chunked
    prefill (256 blocks each); the former default (4 rings, 292 blocks) held about one."""
    from ion_vllm.kv_tier.config import default_window_bytes
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    blk = 28 * 2 * 64 * 4 * 128 * 2  # layers x (K, V) x tokens x KV heads x d x bf16
    assert blk == 3_670_016
    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 24 << 30}, block_bytes=blk))
    assert s.config.ring_bytes == 256 << 20
    assert s.max_inflight_blocks == (4 << 30) // blk > 4 * 256
    assert (4 * s.config.ring_bytes) // blk < 2 * 256
    # small host pools: a quarter of the pool, never below 4 rings
    assert default_window_bytes(256 << 20, 1 << 30) == 4 * (256 << 20)
    assert default_window_bytes(16 << 20, 1 << 30) == 256 << 20
    # per worker: the host budget is shared by the TP ranks
    s2 = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 << 30, "ring_mib": 16}, block_bytes=1 << 20,
                            world=2))
    assert s2.max_inflight_blocks == (1 << 30) // (1 << 20)  # 0.25 x 4 GiB per worker
    # an explicit max_inflight_mib still wins
    s3 = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 24 << 30, "max_inflight_mib": 64},
                            block_bytes=1 << 20))
    assert s3.max_inflight_blocks == 64
    # the scheduler's manager gets the same window and pool from the same config
    m = s3.get_manager()
    assert (m.max_inflight_blocks, m.num_host_blocks) == (64, s3.num_host_blocks)


def test_the_spec_hands_its_config_to_the_worker():
    """The worker the spec builds holds the spec's config (one object for spec, manager
    and worker); ring_mib 0 is a ring of no slots (every block copied directly)."""
    from ion_vllm.kv_tier.spec import IonKVTierSpec

    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 << 10, "ring_mib": 2 / 1024},
                           block_bytes=1 << 10))
    w = s.get_worker(_one_tensor_caches())
    assert w.config is s.config and w.ring.num_slots == 2 and w.num_host_blocks == 8
    assert w is s.get_worker(None)  # built once
    w0 = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 8 << 10, "ring_mib": 0},
                            block_bytes=1 << 10)).get_worker(_one_tensor_caches())
    assert w0.ring.num_slots == 0 and w0.ring.nbytes == 0
    assert w0.ring_gather_impl == "copier" and w0.copier.name == "torch"  # CPU tensors


def _one_tensor_caches(t=None, nb=1 << 10):
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    t = torch.zeros((4, nb), dtype=torch.int8) if t is None else t
    return CanonicalKVCaches(tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=nb)],
                             group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0,
                                                                   page_size_bytes=nb)]])


def test_worker_store_paths_reach_the_managers_metrics():
    """Ring and spill block counts travel worker -> PROCESS_COUNTERS -> the spec's manager
    stats -> Prometheus, so a GPU run shows which path its stores took."""
    import torch
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from ion_vllm.kv_tier.spec import IonKVTierSpec
    from ion_vllm.kv_tier.stats import M
    from ion_vllm.kv_tier.manager import IonHostSpec

    nb = 1 << 10
    s = IonKVTierSpec(_cfg({"cpu_bytes_to_use": 16 * nb, "ring_mib": 2 * nb / (1 << 20)},
                           block_bytes=nb))
    mgr = s.get_manager()
    mgr.get_stats()  # start from here
    t = torch.randint(-100, 100, (8, nb), dtype=torch.int8)
    w = s.get_worker(_one_tensor_caches(t, nb))
    assert w.ring.num_slots == 2
    w.submit_store(1, GPULoadStoreSpec([0, 1, 2, 3, 4], [5], [0]), IonHostSpec([0, 1, 2, 3, 4]))
    w.get_finished()  # the drains are accounted when their end is seen
    red = mgr.get_stats().reduce()
    assert red[M.RING_BLOCKS] == 2 and red[M.SPILL_BLOCKS] == 3
    # every byte written to the host is in the D2H counters, with its copy time
    assert red[M.D2H_BYTES] == 5 * nb and red[M.D2H_SECONDS] > 0
    assert torch.equal(w.host[:5], t[:5])  # the CPU runtime is synchronous


def test_drop_forgets_a_failed_restore_now_or_after_its_last_load():
    """A restore reported invalid drops the host copies (vllm_guards): an idle block is
    freed at once, a block still being loaded when its last load completes; lookups miss
    from the drop on, and a later store of the key takes a fresh host block."""
    from kv_tier_harness import CTX, key_of
    from vllm.v1.kv_offload.base import LookupResult

    from ion_vllm.kv_tier.manager import IonKVTierManager

    m = IonKVTierManager(4, 10, 40, 4, enable_events=True)
    keys = [key_of(i) for i in range(3)]
    out = m.prepare_store(keys, CTX)
    m.complete_store(out.keys_to_store, CTX)
    m.prepare_load([keys[1]], CTX)  # block 1 is being loaded
    list(m.take_events())
    assert m.drop([keys[0], keys[1], key_of(99)]) == 2  # an unknown key is ignored
    assert m.lookup(keys[0], CTX) == m.lookup(keys[1], CTX) == LookupResult.MISS
    assert m.used_blocks == 2 and len(m._free) == 2  # block 1 still held by its load
    m.check_invariants()
    m.complete_load([keys[1]], CTX)
    assert m.used_blocks == 1 and m.counters.dropped_blocks == 2
    assert [(sorted(e.keys), e.removed) for e in m.take_events()] == [
        ([keys[0]], True), ([keys[1]], True)]
    again = m.prepare_store(keys, CTX)  # recomputed blocks are stored again
    assert sorted(again.keys_to_store) == sorted(keys[:2])
    m.check_invariants()
