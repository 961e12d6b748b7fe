"""What the ION attention backend supports, as pure rules.

Nothing here touches a GPU, imports cutlass or needs a vLLM config: every function takes
plain values (ints, strings, ``torch.dtype`` or its name, ``(major, minor)`` tuples) and
returns a list of human-readable reasons.  An empty list means "supported".  Each reason
says what is wrong *and* what to do about it, because vLLM shows these strings verbatim
when ``--attention-backend ION`` is refused.

Two levels:

* :func:`backend_config_reasons` -- what vLLM's attention selector knows when it asks the
  backend ``validate_configuration(...)`` (head size, dtype, KV dtype, block size, GPU, ...).
* :func:`layer_config_reasons` -- what only the attention layer knows when it builds the
  impl (head counts / GQA ratio, ALiBi, logits soft cap, sliding window, sinks, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cute_kernels import options as _kernel  # plain constants, imports nothing heavy

BACKEND_NAME = "ION"

#: Head dimensions the kernel is compiled for.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = _kernel.SUPPORTED_HEAD_DIMS
#: Activation / KV dtypes (torch dtype names without the ``torch.`` prefix).
SUPPORTED_DTYPES: tuple[str, ...] = _kernel.SUPPORTED_DTYPES
#: ``--kv-cache-dtype`` values accepted (no quantized KV cache).
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16")
#: The only GPU generation the kernel is built for (TMA + wgmma, sm_90a).
REQUIRED_COMPUTE_CAPABILITY: tuple[int, int] = (9, 0)
#: KV page size of the kernel (= vLLM kernel block size, = KV tile).
KERNEL_BLOCK_SIZE = _kernel.PAGE_SIZE
#: Largest q-heads-per-KV-head ratio (packed GQA fills the 64-row MMA with 64 // Gp tokens).
MAX_GQA_RATIO = _kernel.MAX_GROUP

_FALLBACK = "use --attention-backend FLASH_ATTN (or leave it unset) for this configuration"

def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _capability_tuple(capability: Any) -> tuple[int, int] | None:
    if capability is None:
        return None
    if hasattr(capability, "major") and hasattr(capability, "minor"):
        return int(capability.major), int(capability.minor)
    if isinstance(capability, int):  # vLLM's to_int() form, e.g. 90
        return capability // 10, capability % 10
    major, minor = capability
    return int(major), int(minor)


def _attn_type_name(attn_type: Any) -> str:
    return str(getattr(attn_type, "value", attn_type))


def head_size_reason(head_size: int) -> str | None:
    if head_size in SUPPORTED_HEAD_SIZES:
        return None
    return (f"{BACKEND_NAME}: head size {head_size} is not supported; the kernel is built "
            f"for head sizes {list(SUPPORTED_HEAD_SIZES)} only -- {_FALLBACK}")


def dtype_reason(dtype: Any) -> str | None:
    name = dtype_name(dtype)
    if name in SUPPORTED_DTYPES:
        return None
    return (f"{BACKEND_NAME}: model dtype {name} is not supported; run with "
            f"--dtype bfloat16 or --dtype float16")


def kv_cache_dtype_reason(kv_cache_dtype: str | None) -> str | None:
    if kv_cache_dtype is None or kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES:
        return None
    return (f"{BACKEND_NAME}: KV cache dtype '{kv_cache_dtype}' is not supported (no "
            f"quantized / fp8 KV cache); run with --kv-cache-dtype auto")


def kv_dtype_matches_reason(kv_cache_dtype: str | None, dtype: Any) -> str | None:
    """An unquantized cache in another dtype than the model's: the kernel reads K/V in
    the query's dtype (and the fused writeback stores them unconverted)."""
    model = dtype_name(dtype)
    if kv_cache_dtype in (None, "auto") or kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES \
            or model not in SUPPORTED_DTYPES or kv_cache_dtype == model:
        return None
    return (f"{BACKEND_NAME}: KV cache dtype {kv_cache_dtype} differs from the model dtype "
            f"{model}; run with --kv-cache-dtype auto (or --kv-cache-dtype {model})")


def block_size_reason(block_size: int | None) -> str | None:
    """``None`` means the user gave no ``--block-size``: vLLM then asks the backend and
    gets the kernel page (64).  A user-given size must be a multiple of it (vLLM splits
    e.g. 128 into kernel pages of 64 through its kernel-block-size mechanism)."""
    page = KERNEL_BLOCK_SIZE
    if block_size is None or (block_size > 0 and block_size % page == 0):
        return None
    return (f"{BACKEND_NAME}: --block-size {block_size} is not supported; the kernel's KV "
            f"page is {page} tokens, so use --block-size {page} "
            f"(or a multiple of it) or leave --block-size unset")


def compute_capability_reason(capability: Any) -> str | None:
    cap = _capability_tuple(capability)
    if cap == REQUIRED_COMPUTE_CAPABILITY:
        return None
    found = "no GPU capability reported" if cap is None else f"sm_{cap[0]}{cap[1]}"
    want = f"sm_{REQUIRED_COMPUTE_CAPABILITY[0]}{REQUIRED_COMPUTE_CAPABILITY[1]}"
    return (f"{BACKEND_NAME}: needs a Hopper GPU ({want}: H100/H200/H20/GH200), found "
            f"{found} -- {_FALLBACK}")


def attn_type_reason(attn_type: Any) -> str | None:
    name = _attn_type_name(attn_type)
    if name == "decoder":
        return None
    return (f"{BACKEND_NAME}: attention type '{name}' is not supported; only causal decoder "
            f"self-attention is (encoder / encoder-decoder models need another backend) -- "
            f"{_FALLBACK}")


def gqa_reason(num_heads: int, num_kv_heads: int) -> str | None:
    if num_kv_heads <= 0 or num_heads <= 0:
        return f"{BACKEND_NAME}: invalid head counts Hq={num_heads}, Hkv={num_kv_heads}"
    if num_heads % num_kv_heads != 0:
        return (f"{BACKEND_NAME}: {num_heads} query heads are not a multiple of "
                f"{num_kv_heads} KV heads -- {_FALLBACK}")
    ratio = num_heads // num_kv_heads
    if ratio > MAX_GQA_RATIO:
        return (f"{BACKEND_NAME}: GQA ratio {ratio} (Hq={num_heads}, Hkv={num_kv_heads} per "
                f"GPU) is above the supported maximum {MAX_GQA_RATIO}; a larger "
                f"--tensor-parallel-size does not help (it divides both) -- {_FALLBACK}")
    return None


def backend_config_reasons(
    head_size: int,
    dtype: Any,
    kv_cache_dtype: str | None,
    block_size: int | None,
    use_mla: bool,
    has_sink: bool,
    use_sparse: bool,
    use_mm_prefix: bool,
    use_per_head_quant_scales: bool,
    device_capability: Any,
    attn_type: Any,
    has_sliding_window: bool = False,
    use_non_causal: bool = False,
    use_batch_invariant: bool = False,
    use_kv_connector: bool = False,
    use_pcp: bool = False,
) -> list[str]:
    """Everything vLLM 0.26's ``AttentionBackend.validate_configuration`` passes in."""
    reasons = [
        head_size_reason(head_size),
        dtype_reason(dtype),
        kv_cache_dtype_reason(kv_cache_dtype),
        kv_dtype_matches_reason(kv_cache_dtype, dtype),
        block_size_reason(block_size),
        compute_capability_reason(device_capability),
        attn_type_reason(attn_type),
    ]
    if use_mla:
        reasons.append(f"{BACKEND_NAME}: MLA models (DeepSeek-style latent attention) are "
                       f"not supported -- {_FALLBACK}")
    if use_sparse:
        reasons.append(f"{BACKEND_NAME}: sparse attention is not supported -- {_FALLBACK}")
    del has_sink  # attention sinks are supported (gpt-oss)
    del has_sliding_window  # per-layer sliding windows are supported
    if use_mm_prefix:
        reasons.append(f"{BACKEND_NAME}: bidirectional multimodal-prefix attention is not "
                       f"supported -- {_FALLBACK}")
    if use_non_causal:
        reasons.append(f"{BACKEND_NAME}: non-causal attention is not supported; drop the "
                       f"non-causal attention option or {_FALLBACK}")
    if use_per_head_quant_scales:
        reasons.append(f"{BACKEND_NAME}: per-head KV quantization scales are not supported; "
                       f"run with --kv-cache-dtype auto")
    if use_pcp:
        reasons.append(f"{BACKEND_NAME}: prefill context parallelism is not supported; "
                       f"run with --prefill-context-parallel-size 1")
    # batch-invariant mode is supported: the builder then plans without split-KV
    del use_kv_connector, use_batch_invariant  # connectors only see the cache tensor
    return [r for r in reasons if r is not None]


def layer_config_reasons(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    kv_cache_dtype: str = "auto",
    alibi_slopes: Sequence[float] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    attn_type: Any = "decoder",
    has_sinks: bool = False,
) -> list[str]:
    """What the attention layer passes to ``IonAttentionImpl.__init__``."""
    reasons = [
        head_size_reason(head_size),
        gqa_reason(num_heads, num_kv_heads),
        kv_cache_dtype_reason(kv_cache_dtype),
        attn_type_reason(attn_type),
    ]
    if alibi_slopes is not None:
        reasons.append(f"{BACKEND_NAME}: ALiBi position biases are not supported -- "
                       f"{_FALLBACK}")
    if sliding_window is not None and not (isinstance(sliding_window, int)
                                           and sliding_window >= 1):
        reasons.append(f"{BACKEND_NAME}: sliding window ({sliding_window}) must be a token "
                       f"count >= 1")
    if logits_soft_cap is not None and not logits_soft_cap >= 0:
        reasons.append(f"{BACKEND_NAME}: logits soft cap ({logits_soft_cap}) must be a "
                       f"number >= 0 (0: none)")
    del has_sinks  # attention sinks are supported (gpt-oss)
    return [r for r in reasons if r is not None]


class IonUnsupportedError(ValueError):
    """Raised when a layer / config cannot run on ION; the message lists every reason."""

    def __init__(self, reasons: Sequence[str]):
        self.reasons = list(reasons)
        super().__init__("ION attention backend cannot run this configuration:\n  - "
                         + "\n  - ".join(self.reasons))


def check_layer(**kwargs: Any) -> None:
    """:func:`layer_config_reasons` that raises :class:`IonUnsupportedError`."""
    reasons = layer_config_reasons(**kwargs)
    if reasons:
        raise IonUnsupportedError(reasons)
