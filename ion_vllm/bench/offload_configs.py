"""Bench helpers of the KV-offloading scripts (scripts/kv_tier_bench.py,
scripts/kv_tier_preempt_check.py): the --kv-transfer-config of each setup they compare
(the Ion tier and vLLM's native CPU offloading, both through vLLM's OffloadingConnector at
the same host budget), and the process's vLLM metrics read as float sums."""

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
    if tier in ("native", "native-default"):
        extra = {"cpu_bytes_to_use": host_bytes}
        if tier == "native":
            extra["offload_prompt_only"] = False
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": extra}
    if tier == "ion":
        return kv_transfer_config_dict(host_bytes / (1 << 30), spec_name=SPEC_CLASS,
                                       spec_module_path=SPEC_MODULE, **ion_extra)
    raise ValueError(f"unknown offloading tier {tier!r}")


def prometheus_sums(prefix: str = "vllm:",
                    split_labels: tuple[str, ...] = ("source",)) -> dict[str, float]:
    """This process's vLLM counters and gauges summed over labels, as floats, read from
    the Prometheus registry directly (``LLM.get_metrics()`` truncates counters to int,
    which turns the seconds of ``vllm:kv_offload_*_time`` into 0).

    Histograms give ``<name>_sum`` and ``<name>_count`` (e.g.
    ``vllm:iteration_tokens_total``: tokens computed over all engine steps, and the number
    of steps).  A sample with a label in ``split_labels`` is also summed under
    ``<name>[<value>]`` (e.g. ``vllm:prompt_tokens_by_source[local_compute]``)."""
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
