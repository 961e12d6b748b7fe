"""Plain-PyTorch entry point of IonAttention: ``ion_attention(...)``.

Kernels are compiled once per variant (dtype, head_dim, group_pad, page) from fake tensors with
symbolic sizes (``--enable-tvm-ffi``), then called with torch tensors directly on the current
torch stream.  Compilation needs no GPU, so the same path compiles every variant for sm_90a on a
CPU machine (``compile_variant``); see tests/test_compile_sm90.py.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from .variants import Variant, group_pad_for, variant_for

_compile_lock = threading.Lock()


def _cutlass_dtype(dtype):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]


def _fake_args(variant: Variant):
    """Fake tensors with symbolic sizes matching the kernel's runtime contract."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dt = _cutlass_dtype(variant.dtype)
    D, P = variant.head_dim, variant.page_size
    div = 8  # 16-byte alignment of every 16-bit stride, required by TMA

    def sym():
        return cute.sym_int()

    def sym_stride():
        return cute.sym_int64(divisibility=div)

    q = make_fake_tensor(dt, (sym(), sym(), D), stride=(sym_stride(), D, 1), assumed_align=16)
    o = make_fake_tensor(dt, (sym(), sym(), D), stride=(sym_stride(), D, 1), assumed_align=16)
    k = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(sym_stride(), sym_stride(), D, 1),
                         assumed_align=16)
    v = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(sym_stride(), sym_stride(), D, 1),
                         assumed_align=16)
    i32 = cutlass.Int32
    qsl = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    seq_lens = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    block_table = make_fake_tensor(i32, (sym(), sym()), stride=(cute.sym_int64(), 1), assumed_align=4)
    work = make_fake_tensor(i32, (sym(), 8), stride=(8, 1), assumed_align=16)
    offsets = make_fake_tensor(i32, (sym(),), stride=(1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, o, qsl, seq_lens, block_table, work, offsets,
            cutlass.Int32(1), cutlass.Float32(1.0), cutlass.Int32(1), stream)


def compile_variant(variant: Variant, *, keep_ptx: bool = False):
    """Compile one kernel variant for sm_90a. Works without a GPU (CUTE_DSL_ARCH=sm_90a)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from .attention_sm90 import IonAttentionSm90

    kernel = IonAttentionSm90(_cutlass_dtype(variant.dtype), variant.head_dim,
                              variant.group_pad, variant.page_size)
    options = "--enable-tvm-ffi"
    if keep_ptx:
        options += " --keep-ptx"
    return cute.compile(kernel, *_fake_args(variant), options=options)


@functools.lru_cache(maxsize=None)
def _compiled(variant: Variant):
    with _compile_lock:
        return compile_variant(variant)


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass
class DevicePlan:
    """Planner output resident on the device (what the kernel reads)."""

    work: torch.Tensor        # int32 [n_items_capacity, 8]
    cta_offsets: torch.Tensor  # int32 [num_ctas + 1]
    num_ctas: int


def check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table):
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must be [T, Hq, D] of one shape, got {tuple(q.shape)} / {tuple(out.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or out.dtype != q.dtype:
        raise TypeError(f"q/out must be bf16 or fp16 of one dtype, got {q.dtype}/{out.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError("k_cache/v_cache dtype must equal q dtype")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, Hkv, page, D], got {tuple(k_cache.shape)}")
    T, Hq, D = q.shape
    _, Hkv, P, Dk = k_cache.shape
    if Dk != D or D not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128 and equal in q and cache, got {D}/{Dk}")
    if Hq % Hkv != 0 or Hq // Hkv > 8:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv}) with ratio <= 8")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            raise ValueError(f"{name} must have a contiguous, 16-byte aligned last dim")
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            raise ValueError(f"{name} strides must be multiples of 16 bytes (TMA)")
    if k_cache.stride(2) != D or v_cache.stride(2) != D:
        raise ValueError("cache pages must be contiguous [page, D] boxes (HND layout)")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")
    return T, Hq, Hkv, D, P


def ion_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                  softmax_scale: float, plan: Optional[DevicePlan] = None, *,
                  query_start_loc_cpu=None, seq_lens_cpu=None):
    """Causal paged attention over a mixed prefill/decode batch; writes ``out`` in place.

    ``plan`` is a DevicePlan built once per step (see ``make_device_plan``).  When None, the
    plan is built here from host copies of ``query_start_loc``/``seq_lens`` (pass them as
    ``*_cpu`` to avoid a device sync).
    """
    T, Hq, Hkv, D, P = check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens,
                                    block_table)
    G = Hq // Hkv
    if plan is None:
        qsl_h = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.cpu()
        sl_h = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()
        plan = make_device_plan(qsl_h, sl_h, num_kv_heads=Hkv, group_size=G, page_size=P,
                                device=q.device)
    if plan.num_ctas == 0 or T == 0:
        return out
    variant = variant_for(q.dtype, D, G, P)
    kernel = _compiled(variant)
    kernel(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, plan.work,
           plan.cta_offsets, G, softmax_scale * 1.4426950408889634, plan.num_ctas)
    return out


def make_device_plan(query_start_loc_cpu, seq_lens_cpu, *, num_kv_heads: int, group_size: int,
                     page_size: int, device, num_ctas: Optional[int] = None,
                     out: Optional[DevicePlan] = None) -> DevicePlan:
    """Run the host planner and place its work list on ``device``.

    With ``out`` given, the plan is written into its preallocated buffers in place (CUDA-graph
    safe: same addresses every step); otherwise fresh tensors are allocated.
    """
    import numpy as np

    from .planner import plan as host_plan

    if num_ctas is None:
        num_ctas = num_sms(torch.device(device)) if torch.cuda.is_available() else 132
    qsl = np.asarray(query_start_loc_cpu, dtype=np.int32)
    sl = np.asarray(seq_lens_cpu, dtype=np.int32)
    p = host_plan(qsl, sl, num_kv_heads=num_kv_heads, group_size=group_size,
                  page_size=page_size, num_ctas=num_ctas, allow_split=False)
    work = torch.from_numpy(np.ascontiguousarray(p.work, dtype=np.int32).reshape(-1, 8))
    offsets = torch.from_numpy(np.ascontiguousarray(p.cta_offsets, dtype=np.int32))
    if out is None:
        n = max(1, work.shape[0])
        w = torch.zeros((n, 8), dtype=torch.int32)
        w[: work.shape[0]] = work
        return DevicePlan(w.to(device), offsets.to(device), num_ctas)
    if work.shape[0] > out.work.shape[0] or offsets.shape[0] != out.cta_offsets.shape[0]:
        raise ValueError("plan does not fit the preallocated device plan buffers")
    out.work[: work.shape[0]].copy_(work, non_blocking=True)
    out.cta_offsets.copy_(offsets, non_blocking=True)
    return out
