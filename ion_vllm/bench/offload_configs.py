"""The --kv-transfer-config of each KV-offloading setup the benchmarks compare: the Ion
tier and vLLM's native CPU offloading, both through vLLM's OffloadingConnector at the
same host budget (scripts/kv_tier_bench.py, scripts/kv_tier_preempt_check.py)."""

from __future__ import annotations

from ion_vllm.kv_tier import SPEC_CLASS, SPEC_MODULE, kv_transfer_config_dict


def offload_transfer_config(tier: str, host_bytes: int, **ion_extra) -> dict | None:
    """``tier``: "ion" (the Ion spec, named by class and module so that a child process
    needs no plugin registration; ``ion_extra``: its kv_connector_extra_config keys),
    "native" (vLLM's CPUOffloadingSpec, decode blocks stored too, as Ion stores them),
    "native-default" (the same spec with vLLM's defaults: prompt blocks only) or "none"
    (None: no offloading)."""
    if tier == "none":
        return None
    if tier == "native-default":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes}}
    if tier == "native":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes,
                                              "offload_prompt_only": False}}
    if tier == "ion":
        return kv_transfer_config_dict(host_bytes / (1 << 30), spec_name=SPEC_CLASS,
                                       spec_module_path=SPEC_MODULE, **ion_extra)
    raise ValueError(f"unknown offloading tier {tier!r}")
