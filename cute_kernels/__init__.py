"""IonAttention CuTeDSL kernels for Hopper, usable from plain PyTorch (never imports vLLM).

Public API (contract: docs/contract.md):
    ion_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                  softmax_scale, plan=None, *, key=None, value=None)
    make_device_plan(query_start_loc_cpu, seq_lens_cpu, *, num_kv_heads, group_size,
                     head_dim, device, fresh_kv=False, tile_m="auto") -> DevicePlan
    kv_append(key, value, k_cache, v_cache, slot_mapping)
    precompile(options, num_kv_heads=None); KernelOptions: the compile-cache key
    reference_paged_attention(...), reference_kv_append(...): the fp32 reference
Imports are lazy, so that ``import cute_kernels`` costs nothing until a kernel is used.
"""

PAGE_SIZE = 64

_EXPORTS = {
    "ion_attention": ("cute_kernels.attention", "ion_attention"),
    "sink_log2": ("cute_kernels.attention", "sink_log2"),
    "precompile": ("cute_kernels.attention", "precompile"),
    "make_device_plan": ("cute_kernels.device_plan", "make_device_plan"),
    "DevicePlan": ("cute_kernels.device_plan", "DevicePlan"),
    "KernelOptions": ("cute_kernels.options", "KernelOptions"),
    "kv_append": ("cute_kernels.append_sm90", "kv_append"),
    "reference_paged_attention": ("cute_kernels.reference", "reference_paged_attention"),
    "reference_kv_append": ("cute_kernels.reference", "reference_kv_append"),
    "plan": ("cute_kernels.planner", "plan"),
}

__all__ = ["PAGE_SIZE", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'cute_kernels' has no attribute {name!r}")
