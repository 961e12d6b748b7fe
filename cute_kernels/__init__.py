"""IonAttention CuTeDSL kernels for Hopper, usable from plain PyTorch (never imports vLLM).

Public API (contract: docs/contract.md):
    ion_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                  softmax_scale, plan=None)
    make_device_plan(query_start_loc_cpu, seq_lens_cpu, num_kv_heads=, group_size=,
                     page_size=, device=)
    kv_append(key, value, k_cache, v_cache, slot_mapping)
    reference_paged_attention(...), reference_kv_append(...)
Imports are lazy so that `import cute_kernels` costs nothing until a kernel is used.
"""

_EXPORTS = {
    "ion_attention": ("cute_kernels.attention", "ion_attention"),
    "make_device_plan": ("cute_kernels.attention", "make_device_plan"),
    "DevicePlan": ("cute_kernels.attention", "DevicePlan"),
    "kv_append": ("cute_kernels.append_sm90", "kv_append"),
    "reference_paged_attention": ("cute_kernels.reference", "reference_paged_attention"),
    "reference_kv_append": ("cute_kernels.reference", "reference_kv_append"),
    "plan": ("cute_kernels.planner", "plan"),
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'cute_kernels' has no attribute {name!r}")
