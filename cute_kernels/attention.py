"""Plain-PyTorch entry point of IonAttention: ``ion_attention(...)``.

Kernels are compiled once per ``KernelOptions`` from fake tensors with symbolic sizes
(``--enable-tvm-ffi``), then called with torch tensors directly on the current torch
stream.  Compilation needs no GPU, so CI compiles every kernel for sm_90a on a CPU.
Compiled kernels persist across processes in ``kernel_cache`` (a later process loads them
without compiling).
"""

from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from . import kernel_cache
from .device_plan import DevicePlan, make_device_plan
from .options import PAGE_SIZE, SUPPORTED_HEAD_DIMS, KernelOptions, group_pad_for

_compile_lock = threading.Lock()
LOG2_E = 1.4426950408889634


def _cutlass_dtype(dtype: str):
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype]


def _fake_args(options: KernelOptions):
    """Fake tensors with symbolic sizes matching the kernel's runtime contract: q, k_cache,
    v_cache, out, query_start_loc, seq_lens, block_table, work, cta_offsets,
    partial_offsets, partial_o, partial_lse, sinks_log2, group_size, scale, softcap,
    softcap_in, window, num_ctas, stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .worklist import WORK_COLS

    dt = _cutlass_dtype(options.dtype)
    D, P = options.head_dim, PAGE_SIZE
    sym = cute.sym_int

    def stride16():  # every 16-bit stride a multiple of 16 bytes, as TMA needs
        return cute.sym_int64(divisibility=8)

    def vec(dtype, align=4):
        return make_fake_tensor(dtype, (sym(),), stride=(1,), assumed_align=align)

    q = make_fake_tensor(dt, (sym(), sym(), D), stride=(stride16(), D, 1), assumed_align=16)
    o = make_fake_tensor(dt, (sym(), sym(), D), stride=(stride16(), D, 1), assumed_align=16)
    k = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(stride16(), stride16(), D, 1),
                         assumed_align=16)
    v = make_fake_tensor(dt, (sym(), sym(), P, D), stride=(stride16(), stride16(), D, 1),
                         assumed_align=16)
    i32 = cutlass.Int32
    qsl = vec(i32)
    seq_lens = vec(i32)
    block_table = make_fake_tensor(i32, (sym(), sym()), stride=(cute.sym_int64(), 1),
                                   assumed_align=4)
    work = make_fake_tensor(i32, (sym(), WORK_COLS), stride=(WORK_COLS, 1), assumed_align=16)
    cta_offsets = vec(i32)
    partial_offsets = vec(i32)
    partial_o = make_fake_tensor(cutlass.Float32, (sym(), D), stride=(D, 1), assumed_align=16)
    partial_lse = vec(cutlass.Float32)
    sinks_log2 = vec(cutlass.Float32)
    return (q, k, v, o, qsl, seq_lens, block_table, work, cta_offsets, partial_offsets,
            partial_o, partial_lse, sinks_log2, cutlass.Int32(1), cutlass.Float32(1.0),
            cutlass.Float32(0.0), cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(1),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def kernel_and_fake_args(options: KernelOptions):
    """The attention kernel of ``options`` (``fused`` for ``fresh_kv``) and the fake
    arguments it compiles with; a fused call takes the step's new key/value ([T, Hkv, D],
    any 16-byte token/head strides: views of the fused qkv projection) after q."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    from .attention_sm90 import IonAttentionSm90

    kernel = IonAttentionSm90(options)
    args = _fake_args(options)
    if not options.fresh_kv:
        return kernel, args

    def new_kv():
        return make_fake_tensor(_cutlass_dtype(options.dtype),
                                (cute.sym_int(), cute.sym_int(), options.head_dim),
                                stride=(cute.sym_int64(divisibility=8),
                                        cute.sym_int64(divisibility=8), 1),
                                assumed_align=16)

    return kernel.fused, (args[0], new_kv(), new_kv()) + tuple(args[1:])


def combine_kernel_and_fake_args(options: KernelOptions):
    """The split-KV combine kernel of ``options.combine_key`` and its fake arguments."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .combine_sm90 import CombineSm90
    from .worklist import COMBINE_COLS

    dt = _cutlass_dtype(options.dtype)
    D = options.head_dim
    sym = cute.sym_int
    o = make_fake_tensor(dt, (sym(), sym(), D), stride=(cute.sym_int64(divisibility=8), D, 1),
                         assumed_align=16)
    qsl = make_fake_tensor(cutlass.Int32, (sym(),), stride=(1,), assumed_align=4)
    comb = make_fake_tensor(cutlass.Int32, (sym(), COMBINE_COLS), stride=(COMBINE_COLS, 1),
                            assumed_align=4)
    po = make_fake_tensor(cutlass.Float32, (sym(), D), stride=(D, 1), assumed_align=16)
    plse = make_fake_tensor(cutlass.Float32, (sym(),), stride=(1,), assumed_align=4)
    sinks = make_fake_tensor(cutlass.Float32, (sym(),), stride=(1,), assumed_align=4)
    kernel = CombineSm90(dt, D, options.group_pad)
    return kernel, (o, qsl, comb, po, plse, sinks, cutlass.Int32(1), cutlass.Int32(1),
                    make_fake_stream(use_tvm_ffi_env_stream=True))


def _compile(kernel_and_args):
    import cutlass.cute as cute

    kernel, args = kernel_and_args
    with _compile_lock:
        return cute.compile(kernel, *args, options="--enable-tvm-ffi")


@functools.lru_cache(maxsize=None)
def compiled_attention(options: KernelOptions):
    return kernel_cache.load_or_compile(
        ("attention", options), lambda: _compile(kernel_and_fake_args(options)))


@functools.lru_cache(maxsize=None)
def _compiled_combine(combine_key: tuple):
    options = KernelOptions(*combine_key)
    return kernel_cache.load_or_compile(
        ("combine", combine_key), lambda: _compile(combine_kernel_and_fake_args(options)))


def compiled_combine(options: KernelOptions):
    return _compiled_combine(options.combine_key)


def precompile(options, *, num_kv_heads: Optional[int] = None,
               slot_dtype=torch.int64) -> None:
    """Compile and load every kernel that launches with ``options`` (an iterable of
    ``KernelOptions``): the attention kernels, their combine kernels, and ``kv_append``
    where a non-fused option needs it (``num_kv_heads`` given).  Call it before CUDA-graph
    capture, so that no compilation happens inside it."""
    from .append_sm90 import compiled_kv_append

    options = tuple(options)
    for o in options:
        compiled_attention(o)
        compiled_combine(o)
    plain = [o for o in options if not o.fresh_kv]
    if plain and num_kv_heads is not None:
        o = plain[0]
        compiled_kv_append(getattr(torch, o.dtype), o.head_dim, num_kv_heads, PAGE_SIZE,
                           slot_dtype)


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _check_tma_operand(name, t):
    if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must have a contiguous, 16-byte aligned last dim")
    if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
        raise ValueError(f"{name} strides must be multiples of 16 bytes (TMA)")


def check_new_kv(q, key, value, k_cache):
    """Shape / dtype / layout checks of the step's new K/V for the fused-writeback call
    (device-independent, so they run on the CPU as well)."""
    if (key is None) != (value is None):
        raise ValueError("pass both key and value (fused KV writeback) or neither")
    if key is None:
        return
    want = (q.shape[0], k_cache.shape[1], k_cache.shape[3]) if k_cache.dim() == 4 else None
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or (want is not None and tuple(t.shape) != want):
            raise ValueError(f"{name} must be [T, Hkv, D] = {want} (T rows of q, the cache's "
                             f"Hkv and D), got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype must equal q dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        _check_tma_operand(name, t)


def check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                 key=None, value=None):
    """Refuse, with a reason, every input the kernel does not implement (never a wrong
    answer or a fault inside the kernel).  Returns (T, Hq, Hkv, D)."""
    check_new_kv(q, key, value, k_cache)
    tensors = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table)
    if not all(t.is_cuda and t.device == q.device for t in tensors):
        raise ValueError("IonAttention needs every tensor on the same CUDA device")
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if not _is_hopper(index):
        raise RuntimeError("IonAttention needs an sm_90 (Hopper: H100/H200/GH200) GPU; "
                           f"{torch.cuda.get_device_name(q.device)} is not one")
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must be [T, Hq, D] of one shape, got {tuple(q.shape)} "
                         f"/ {tuple(out.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or out.dtype != q.dtype:
        raise TypeError(f"q/out must be bf16 or fp16 of one dtype, got {q.dtype}/{out.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError("k_cache/v_cache dtype must equal q dtype")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache/v_cache must be [num_blocks, Hkv, page, D], got "
                         f"{tuple(k_cache.shape)}")
    T, Hq, D = q.shape
    _, Hkv, P, Dk = k_cache.shape
    if P != PAGE_SIZE:
        raise ValueError(f"IonAttention pages hold {PAGE_SIZE} tokens, got {P}")
    if Dk != D or D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} and equal in q and "
                         f"cache, got {D}/{Dk}")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    group_pad_for(Hq // Hkv)  # refuses ratios past MAX_GROUP
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tma_operand(name, t)
    if k_cache.stride(2) != D or v_cache.stride(2) != D:
        raise ValueError("cache pages must be contiguous [page, D] boxes (HND layout)")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous in its last dim")
    return T, Hq, Hkv, D


_NO_SINKS: dict = {}


def _no_sinks(device, num_q_heads: int):
    """A persistent fp32 [Hq] of -inf (no sink adds 0): made once, CUDA-graph safe."""
    key = (str(device), num_q_heads)
    t = _NO_SINKS.get(key)
    if t is None:
        t = _NO_SINKS[key] = torch.full((num_q_heads,), float("-inf"), dtype=torch.float32,
                                        device=device)
    return t


def sink_log2(sinks):
    """A layer's attention-sink logits (``[Hq]``, natural-log units, as gpt-oss stores
    them) as the kernels read them: fp32, times log2(e)."""
    return sinks.detach().float() * LOG2_E


def ion_attention(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
                  softmax_scale: float, plan: Optional[DevicePlan] = None, *,
                  key=None, value=None, query_start_loc_cpu=None, seq_lens_cpu=None,
                  softcap: float = 0.0, window: int = 0, sinks_log2=None):
    """Causal paged attention over a mixed prefill/decode batch; writes ``out`` in place.

    ``plan`` is a ``DevicePlan`` made once per step; when None it is planned here from host
    copies of ``query_start_loc``/``seq_lens`` (pass them as ``*_cpu`` to avoid a sync).
    Launches the attention kernel, then the split-KV combine when the plan needs it.

    ``key``/``value`` (``[T, Hkv, D]``, rows aligned with ``q``): eager KV writeback.  The
    launch reads the step's new K/V from them and also writes them into ``k_cache`` /
    ``v_cache`` at positions ``seq_len - q_len ..`` through ``block_table`` (what
    ``kv_append`` with the block-table slot mapping would write).  ``plan`` must then be
    made with ``fresh_kv=True``.  Cache slots of a request's last page past ``seq_len`` may
    receive garbage (docs/contract.md).

    ``softcap`` > 0: logits soft cap, ``softcap * tanh(softmax_scale * q.k / softcap)``.
    ``window`` > 0: sliding window of that many tokens (a query sees its last ``window``
    keys); ``plan`` must be made with the same window.
    ``sinks_log2``: fp32 ``[Hq]`` attention-sink logits times log2(e) (``sink_log2(sinks)``,
    made once per layer); each joins its q head's softmax denominator with a zero value.
    """
    T, Hq, Hkv, D = check_inputs(q, k_cache, v_cache, out, query_start_loc, seq_lens,
                                 block_table, key, value)
    G = Hq // Hkv
    fused = key is not None
    if plan is None:
        qsl_h = query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc.cpu()
        sl_h = seq_lens_cpu if seq_lens_cpu is not None else seq_lens.cpu()
        plan = make_device_plan(qsl_h, sl_h, num_kv_heads=Hkv, group_size=G, head_dim=D,
                                device=q.device, fresh_kv=fused, window=window)
    if plan.fresh_kv is not None and plan.fresh_kv != fused:
        raise ValueError("plan kind does not match the call: key/value given needs a "
                         "fresh_kv=True plan, a call without them a fresh_kv=False plan")
    if plan.window is not None and plan.window != window:
        raise ValueError(f"plan was pruned for a window of {plan.window} tokens, the call "
                         f"asks for {window}: plan with the layer's window")
    if T == 0:
        return out
    options = KernelOptions.for_layer(q.dtype, D, Hq, Hkv, plan.tile_m, fused)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
    # with a soft cap the scale is applied inside tanh: the softmax then runs in e units
    scale_log2 = LOG2_E if softcap > 0 else softmax_scale * LOG2_E
    if window < 0:
        raise ValueError(f"window must be >= 0 tokens (0: none), got {window}")
    cap_args = (float(softcap), softmax_scale / softcap if softcap > 0 else 0.0, int(window))
    sinks2 = _no_sinks(q.device, Hq) if sinks_log2 is None else sinks_log2
    if sinks2.dtype != torch.float32 or tuple(sinks2.shape) != (Hq,) \
            or sinks2.device != q.device:
        raise ValueError(f"sinks_log2 must be fp32 [{Hq}] on {q.device}")
    if fused:
        compiled_attention(options)(
            q, key, value, k_cache, v_cache, out, query_start_loc, seq_lens, block_table,
            plan.work, plan.cta_offsets, plan.partial_offsets, plan.partial_o,
            plan.partial_lse, sinks2, G, scale_log2, *cap_args, plan.num_ctas)
    else:
        compiled_attention(options)(
            q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, plan.work,
            plan.cta_offsets, plan.partial_offsets, plan.partial_o, plan.partial_lse, sinks2,
            G, scale_log2, *cap_args, plan.num_ctas)
    if plan.always_combine or plan.num_groups > 0:
        compiled_combine(options)(out, query_start_loc, plan.combine, plan.partial_o,
                                  plan.partial_lse, sinks2, G, plan.num_ctas)
    return out
