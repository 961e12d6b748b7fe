"""``kv_append``: scatter new K/V rows into the paged ("HND") KV cache.

CuTeDSL kernel + plain-PyTorch entry point (see docs/contract.md)::

    kv_append(key, value, k_cache, v_cache, slot_mapping)

* ``key``/``value``: ``[T_pad, Hkv, D]`` bf16/fp16, last dim contiguous, any
  token/head strides that are multiples of 8 elements (vLLM passes views of a
  fused qkv tensor).  Only the first ``T = len(slot_mapping)`` tokens are used.
* ``k_cache``/``v_cache``: ``[num_blocks, Hkv, P, D]`` views, last dim
  contiguous (normally ``cache[:, 0]`` / ``cache[:, 1]`` of a
  ``[num_blocks, 2, Hkv, P, D]`` tensor, so not contiguous overall).
* ``slot_mapping``: int32 or int64 ``[T]``; token ``i`` goes to page
  ``slot // P``, row ``slot % P``.  Negative slots are skipped.  Slots
  ``>= num_blocks * P`` are also skipped by the kernel (checking them on the
  host would need a device sync).

Kernel: one CTA per token, each thread moves 16-byte vectors (8 elements) of
K and of V for that token (all heads, both caches in one launch), i.e.
``Hkv * D / 8`` vectors per tensor per token, ``min(Hkv * D / 8, 256)``
threads.

Runtime path: the kernel is compiled once per (dtype, D, Hkv, P, slot dtype,
arch) with TVM-FFI enabled and a TVM-FFI "environment stream", so the compiled
function takes the torch tensors directly and launches on
``torch.cuda.current_stream()``: no host sync, no allocation -> usable under
CUDA-graph capture.  The TVM-FFI wrapper re-checks dtypes, static extents,
16-byte alignment and stride divisibility at each call; the Python-side
validation below only exists to give clearer error messages first.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Tuple

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

__all__ = ["kv_append", "KVAppendKernel", "kv_append_fake_args", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_VEC = 8  # elements per 16-byte vector (bf16 / fp16)
_MAX_THREADS = 256

_TORCH_TO_CUTE = {
    torch.float16: cutlass.Float16,
    torch.bfloat16: cutlass.BFloat16,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
}


class KVAppendKernel:
    """CuTeDSL kernel specialised on (Hkv, D, P); dtypes come from the tensors."""

    def __init__(self, num_kv_heads: int, head_dim: int, page_size: int):
        if head_dim % _VEC != 0:
            raise ValueError(f"head_dim must be a multiple of {_VEC}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.vecs_per_head = head_dim // _VEC
        self.vecs_per_token = num_kv_heads * self.vecs_per_head
        self.threads = min(self.vecs_per_token, _MAX_THREADS)
        self.iters = (self.vecs_per_token + self.threads - 1) // self.threads
        self.needs_guard = self.iters * self.threads != self.vecs_per_token

    @cute.jit
    def __call__(
        self,
        m_key: cute.Tensor,
        m_value: cute.Tensor,
        m_k_cache: cute.Tensor,
        m_v_cache: cute.Tensor,
        m_slots: cute.Tensor,
        stream,
    ):
        num_tokens = m_slots.shape[0]
        num_slots = cutlass.Int64(m_k_cache.shape[0]) * self.page_size
        self.kernel(m_key, m_value, m_k_cache, m_v_cache, m_slots, num_slots).launch(
            grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        m_key: cute.Tensor,
        m_value: cute.Tensor,
        m_k_cache: cute.Tensor,
        m_v_cache: cute.Tensor,
        m_slots: cute.Tensor,
        num_slots: cutlass.Int64,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, _, _ = cute.arch.block_idx()
        slot = cutlass.Int64(m_slots[token])
        if slot >= 0 and slot < num_slots:
            page = slot // self.page_size
            row = slot - page * self.page_size
            for it in cutlass.range_constexpr(self.iters):
                v = tidx + it * self.threads
                if cutlass.const_expr(self.needs_guard):
                    if v < self.vecs_per_token:
                        self._move(m_key, m_value, m_k_cache, m_v_cache, token, page, row, v)
                else:
                    self._move(m_key, m_value, m_k_cache, m_v_cache, token, page, row, v)

    @cute.jit
    def _move(self, m_key, m_value, m_k_cache, m_v_cache, token, page, row, v):
        head = v // self.vecs_per_head
        chunk = v - head * self.vecs_per_head
        # 8-element, 16-byte aligned slices (strides are multiples of 8 and the
        # base pointers 16-byte aligned: both promised by the compiled signature)
        k_src = cute.local_tile(m_key[token, head, None], (_VEC,), (chunk,))
        v_src = cute.local_tile(m_value[token, head, None], (_VEC,), (chunk,))
        k_dst = cute.local_tile(m_k_cache[page, head, row, None], (_VEC,), (chunk,))
        v_dst = cute.local_tile(m_v_cache[page, head, row, None], (_VEC,), (chunk,))
        k_vec = k_src.load()
        v_vec = v_src.load()
        k_dst.store(k_vec)
        v_dst.store(v_vec)


def _stride_sym():
    # every non-unit stride is a runtime value promised to be a multiple of 8
    # elements (16 bytes): this is what lets the loads/stores be 128-bit.
    return cute.sym_int64(divisibility=_VEC)


def kv_append_fake_args(
    dtype: Any, head_dim: int, num_kv_heads: int, page_size: int, index_dtype: Any,
    use_env_stream: bool = True,
) -> Tuple[Any, ...]:
    """Fake (CPU-only) compile-time arguments of :class:`KVAppendKernel`."""
    dt = _TORCH_TO_CUTE[dtype] if isinstance(dtype, torch.dtype) else dtype
    it = _TORCH_TO_CUTE[index_dtype] if isinstance(index_dtype, torch.dtype) else index_dtype
    if dt not in (cutlass.Float16, cutlass.BFloat16):
        raise TypeError(f"kv_append supports fp16/bf16, not {dt}")
    if it not in (cutlass.Int32, cutlass.Int64):
        raise TypeError(f"slot_mapping must be int32 or int64, not {it}")

    def kv_rows():
        return make_fake_tensor(
            dt, (cute.sym_int32(), num_kv_heads, head_dim),
            (_stride_sym(), _stride_sym(), 1), assumed_align=16,
        )

    def cache():
        # a fresh SymInt per tensor: K and V caches may differ in num_blocks
        # only in pathological cases, but they never need to share symbols.
        return make_fake_tensor(
            dt, (cute.sym_int32(), num_kv_heads, page_size, head_dim),
            (_stride_sym(), _stride_sym(), _stride_sym(), 1), assumed_align=16,
        )

    slots = make_fake_tensor(it, (cute.sym_int32(),), (1,), assumed_align=it.width // 8)
    return (
        kv_rows(), kv_rows(), cache(), cache(), slots,
        make_fake_stream(use_tvm_ffi_env_stream=use_env_stream),
    )


_CACHE: Dict[Tuple, Any] = {}
_CACHE_LOCK = threading.Lock()


def compiled_kv_append(dtype: torch.dtype, head_dim: int, num_kv_heads: int,
                     page_size: int, index_dtype: torch.dtype) -> Any:
    key = (dtype, head_dim, num_kv_heads, page_size, index_dtype)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        # Without it TVM-FFI cannot query torch's current stream and would
        # launch on the NULL stream (wrong stream, breaks graph capture).
        raise RuntimeError(
            "kv_append needs torch.Tensor.__dlpack_c_exchange_api__ (torch >= 2.9 "
            "or the torch-c-dlpack-ext package) to launch on the current stream"
        )
    from . import kernel_cache

    def compile_it():
        kernel = KVAppendKernel(num_kv_heads, head_dim, page_size)
        args = kv_append_fake_args(dtype, head_dim, num_kv_heads, page_size, index_dtype)
        return cute.compile(kernel, *args, options="--enable-tvm-ffi")

    with _CACHE_LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            fn = kernel_cache.load_or_compile(("kv_append",) + tuple(map(str, key)), compile_it)
            _CACHE[key] = fn
    return fn


def _safe_strides(t: torch.Tensor) -> torch.Tensor:
    """Strides of size-1 dims are meaningless in torch and may be anything
    (e.g. 1 for a [1, Hkv, D] slice); give them a value that satisfies the
    kernel's 16-byte divisibility contract.  A pure view: no copy, no alloc."""
    if all(s != 1 or st % _VEC == 0 for s, st in zip(t.shape[:-1], t.stride()[:-1])):
        return t
    strides = [
        (_VEC if (s == 1 and st % _VEC != 0) else st)
        for s, st in zip(t.shape[:-1], t.stride()[:-1])
    ] + [t.stride()[-1]]
    return t.as_strided(t.shape, strides, t.storage_offset())


def _check_layout(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}")
    elt = t.element_size()
    if t.data_ptr() % 16 != 0:
        raise ValueError(f"{name}: data pointer must be 16-byte aligned")
    for dim, (s, st) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
        if s != 1 and (st * elt) % 16 != 0:
            raise ValueError(
                f"{name}: stride of dim {dim} ({st} elements) must be a multiple of 16 bytes"
            )


def kv_append(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` rows into ``k_cache``/``v_cache`` in place.

    Token ``i < len(slot_mapping)`` is written to page ``slot // P``, row
    ``slot % P`` of every KV head; negative (and out-of-range) slots are
    skipped.  Asynchronous on ``torch.cuda.current_stream()``; safe under CUDA
    graph capture (the first call for a new configuration compiles the kernel
    and must happen outside capture, e.g. during warm-up).
    """
    tensors = {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
               "slot_mapping": slot_mapping}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"key/value must be [T, Hkv, D], got {tuple(key.shape)} / {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(
            f"k_cache/v_cache must be [num_blocks, Hkv, P, D], got "
            f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")

    dtype = key.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"key dtype must be float16 or bfloat16, got {dtype}")
    for name in ("value", "k_cache", "v_cache"):
        if tensors[name].dtype != dtype:
            raise TypeError(f"{name} dtype {tensors[name].dtype} != key dtype {dtype}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")

    num_blocks, hkv, page_size, head_dim = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim D={head_dim} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if tuple(key.shape[1:]) != (hkv, head_dim) or tuple(value.shape[1:]) != (hkv, head_dim):
        raise ValueError(
            f"key/value {tuple(key.shape)} / {tuple(value.shape)} do not match the cache "
            f"(Hkv={hkv}, D={head_dim})"
        )
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    num_tokens = slot_mapping.shape[0]
    if num_tokens > key.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} entries but key only {key.shape[0]} tokens")
    device = k_cache.device
    if device.type != "cuda":
        raise ValueError(f"kv_append needs CUDA tensors; k_cache is on {device}")
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (same as k_cache)")
    if num_tokens == 0 or num_blocks == 0:
        return

    key, value, k_cache_v, v_cache_v = (
        _safe_strides(key), _safe_strides(value), _safe_strides(k_cache), _safe_strides(v_cache)
    )
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache_v), ("v_cache", v_cache_v)):
        _check_layout(name, t)
    if slot_mapping.stride(0) != 1:
        if num_tokens > 1:
            raise ValueError("slot_mapping must be contiguous")
        slot_mapping = slot_mapping.as_strided((1,), (1,), slot_mapping.storage_offset())

    fn = compiled_kv_append(dtype, head_dim, hkv, page_size, slot_mapping.dtype)
    fn(key, value, k_cache_v, v_cache_v, slot_mapping)
