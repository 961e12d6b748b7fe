"""Ion KV tier: eager KV block writeback to pinned host memory via an HBM
staging ring, restored on prefix hits and after preemption.  Plugs into vLLM's
OffloadingConnector as the offloading spec ``IonKVTier`` (see docs/kv_tier.md).
"""

from __future__ import annotations

import os

SPEC_NAME = "IonKVTier"
SPEC_MODULE = "ion_vllm.kv_tier.spec"
SPEC_CLASS = "IonKVTierSpec"
ENV_GB = "ION_KV_TIER_GB"

_registered = False
_env_patched = False


def register_kv_tier() -> None:
    """Register the spec with vLLM's OffloadingSpecFactory (cheap, idempotent:
    the spec module is imported lazily by the factory).  Also installs the
    ION_KV_TIER_GB short form when that variable is set."""
    global _registered
    if not _registered:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        if SPEC_NAME not in OffloadingSpecFactory._registry:
            OffloadingSpecFactory.register_spec(SPEC_NAME, SPEC_MODULE, SPEC_CLASS)
        _registered = True
    if os.environ.get(ENV_GB):
        _install_env_switch()


def kv_transfer_config_dict(host_gib: float, **extra) -> dict:
    """The --kv-transfer-config that selects the Ion tier with host_gib GiB."""
    cfg = {"spec_name": SPEC_NAME, "cpu_bytes_to_use": int(host_gib * (1 << 30))}
    cfg.update(extra)
    # recompute: a block whose restore failed is recomputed, not its request failed
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": cfg}


def _install_env_switch() -> None:
    """ION_KV_TIER_GB=<GiB>: when the user gave neither --kv-transfer-config
    nor --kv-offloading-size, EngineArgs.create_engine_config fills in the
    OffloadingConnector + IonKVTier config (the standard-flag equivalent)."""
    global _env_patched
    if _env_patched:
        return
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_ion_kv_tier", False):
        _env_patched = True
        return

    def create_engine_config(self, *args, **kwargs):
        gib = os.environ.get(ENV_GB)
        if gib and self.kv_transfer_config is None and self.kv_offloading_size is None:
            from vllm.config import KVTransferConfig

            self.kv_transfer_config = KVTransferConfig(
                **kv_transfer_config_dict(float(gib)))
        return orig(self, *args, **kwargs)

    create_engine_config._ion_kv_tier = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    _env_patched = True


__all__ = ["register_kv_tier", "kv_transfer_config_dict", "SPEC_NAME"]
