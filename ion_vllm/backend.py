"""ION attention backend for vLLM 0.26's v1 attention interface.

* KV cache: one tensor per layer, ``(num_blocks, 2, num_kv_heads, 64, head_size)`` (HND pages,
  ``k = cache[:, 0]``, ``v = cache[:, 1]``); the physical layout is exactly that shape.
* ``forward`` runs one ``cute_kernels.ion_attention`` launch per layer that also writes the
  step's new K/V into the cache (eager writeback, docs/contract.md).  Where that cannot run
  (batch-invariant mode, layers that share another layer's cache) it writes them with
  ``cute_kernels.kv_append`` first.  vLLM's own cache-write ops are never used.
* The metadata builder plans the step's work list once on the host
  (``cute_kernels.planner.plan``) and copies it into device buffers that are allocated once,
  so CUDA-graph capture and replay keep reading valid pointers.

This module imports torch and vLLM but neither cutlass nor the kernels at import time; they
are imported on first use inside the builder / impl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import get_num_attention_heads_from_layers
from vllm.v1.kv_cache_interface import AttentionSpec

from cute_kernels.options import WARPGROUP_ROWS, KernelOptions, tile_ms_for
from ion_vllm import validation
from ion_vllm.registration import BACKEND_NAME, install_enum_alias

logger = init_logger(__name__)

# vLLM's Attention layer looks its backend up with AttentionBackendEnum[get_name()]; make
# "ION" resolvable in any process that imports this module, even without the plugin hook.
install_enum_alias()

KERNEL_BLOCK_SIZE = validation.KERNEL_BLOCK_SIZE


def _kernels():
    """The two kernels ``forward`` launches, imported on first use (they pull in CuTeDSL)."""
    from types import SimpleNamespace

    from cute_kernels.append_sm90 import kv_append
    from cute_kernels.attention import ion_attention, sink_log2

    return SimpleNamespace(kv_append=kv_append, ion_attention=ion_attention,
                           sink_log2=sink_log2)


def _planner():
    from cute_kernels import planner

    return planner


# --------------------------------------------------------------------------- metadata
@dataclass
class IonAttentionMetadata(AttentionMetadata):
    num_actual_tokens: int  # may include CUDA-graph padding tokens (slot_mapping < 0)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device, includes the new tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_pages], device
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], device
    plan: Any  # cute_kernels.device_plan.DevicePlan (the builder's persistent buffers)
    causal: bool | torch.Tensor = True


# --------------------------------------------------------------------------- builder
def model_shares_kv_cache(vllm_config) -> bool:
    """Whether any attention layer of the model reads another layer's KV cache
    (``kv_sharing_target_layer_name``): such a layer gets no key/value of its own."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)
    except (ImportError, AttributeError):
        return False
    return any(getattr(layer, "kv_sharing_target_layer_name", None) for layer in layers.values())


def mixed_batches_run_full_graphs(vllm_config) -> bool:
    """Whether vLLM captures mixed prefill/decode batches in FULL CUDA graphs (mode FULL):
    the kernel baked into such a graph must not depend on the batch."""
    try:
        from vllm.config import CUDAGraphMode
        mode = vllm_config.compilation_config.cudagraph_mode
        return mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL
    except (AttributeError, ImportError):
        return True  # unknown: assume the strict case


def batch_invariant_mode() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_BATCH_INVARIANT)


@dataclass(frozen=True)
class StepPolicy:
    """How this engine plans its steps, fixed at start-up.

    ``fresh_kv``: eager KV writeback inside the attention launch (else ``kv_append``).
    ``unpacked``: long prefill rows of a padded GQA group are tiled one q head x 64 tokens.
    ``tile_ms``: the q-tile sizes steps may run (64 only, or 64/128/192 per step; 64/128
    at head size 256).
    ``allow_split``: split-KV (reduces a row's pages in a batch-dependent grouping)."""

    fresh_kv: bool
    unpacked: bool
    tile_ms: tuple[int, ...]
    allow_split: bool

    @classmethod
    def for_engine(cls, vllm_config: VllmConfig, head_size: int = 128) -> "StepPolicy":
        invariant = batch_invariant_mode()
        shares = model_shares_kv_cache(vllm_config)
        if invariant:
            # split-KV, unpacked tiling and wider tiles would make a row's reduction order
            # depend on the batch; fresh tiles start at a chunk's first new token, so its
            # KV tiling would depend on the chunking
            logger.info("ION: VLLM_BATCH_INVARIANT=1: kv_append, 64-row packed tiles, "
                        "no split-KV")
        elif shares:
            logger.info("ION: the model has KV-sharing layers, which get no key/value of "
                        "their own: kv_append instead of eager writeback")
        wide = not invariant and not mixed_batches_run_full_graphs(vllm_config)
        return cls(fresh_kv=not (invariant or shares), unpacked=not invariant,
                   tile_ms=tile_ms_for(head_size) if wide else (WARPGROUP_ROWS,),
                   allow_split=not invariant)


class IonAttentionMetadataBuilder(AttentionMetadataBuilder[IonAttentionMetadata]):
    """Builds :class:`IonAttentionMetadata` and the step's work-list plan.

    The plan is computed once per step (not per layer) on the host by
    ``cute_kernels.planner.plan`` from vLLM's host copies of ``query_start_loc`` /
    ``seq_lens`` and uploaded (non-blocking, from pinned buffers) into a ``DevicePlan`` per
    q-tile size, allocated here once at the planner's worst case.  The kernel runs a fixed
    persistent grid and reads its whole schedule from those buffers, and the combine pass is
    always launched, so a captured launch is valid for any later batch.  A step whose batch
    has the same ``planner.plan_reuse_key`` as the last step planned at its tile size reuses
    that plan (and its device copy while still resident): ``plan`` would return an equal
    one, and planning is host time the GPU waits for.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    # The kernel handles mixed prefill + decode in one launch: no batch reordering needed.
    reorder_batch_threshold: int | None = None
    max_splits: ClassVar[int] = 16
    #: split-KV workspace rows (fp32 [rows, D]) a CTA; the planner only splits within them
    partial_rows_per_cta: ClassVar[int] = 4 * WARPGROUP_ROWS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.block_size != KERNEL_BLOCK_SIZE:
            raise ValueError(f"ION needs a kernel KV block size of {KERNEL_BLOCK_SIZE}, got "
                             f"{kv_cache_spec.block_size}; use --block-size {KERNEL_BLOCK_SIZE}")
        self.policy = StepPolicy.for_engine(vllm_config, kv_cache_spec.head_size)
        model_config = vllm_config.model_config
        scheduler_config = vllm_config.scheduler_config
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        # a sliding-window KV group (vLLM gives local layers their own SlidingWindowSpec
        # group and builder): its plans leave out the pages outside every query's window
        self.window = int(getattr(kv_cache_spec, "sliding_window", None) or 0)
        self.num_q_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                            or model_config.get_num_attention_heads(vllm_config.parallel_config))
        self.group_size = self.num_q_heads // self.num_kv_heads
        spec = vllm_config.speculative_config
        num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        if spec is not None and getattr(spec, "parallel_drafting", False):
            num_spec *= 2
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        # seq_lens_cpu_upper_bound may run ahead by the speculative tokens
        self.max_seq_len_bound = model_config.max_model_len + num_spec

        from cute_kernels.device_plan import grid_ctas

        self.num_ctas = {tm: grid_ctas(self.device, tm, self.head_size)
                         for tm in self.policy.tile_ms}
        #: split-KV workspace rows of every tile size's buffers: sized by the 64-row grid
        self.partial_rows = (self.partial_rows_per_cta
                             * grid_ctas(self.device, WARPGROUP_ROWS, self.head_size)
                             if self.policy.allow_split else 0)
        #: one DevicePlan per q-tile size (they differ in CTA count and item bound)
        self.plans = {tm: self._device_plan(tm) for tm in self.policy.tile_ms}
        #: tile_m -> (plan_reuse_key, host plan) of the last step planned at that size
        self._last_plans: dict[int, tuple[bytes, Any]] = {}
        #: steps planned / steps that reused the previous plan (diagnostics, tests)
        self.plans_made = 0
        self.plans_reused = 0
        logger.info_once("ION: %s, q tiles of %s rows", "eager KV writeback"
                         if self.policy.fresh_kv else "kv_append + attention",
                         "/".join(map(str, self.policy.tile_ms)))
        if self.device.type == "cuda":
            # compile + load every kernel now: vLLM's profiling run has no attention metadata,
            # so the first real launch could otherwise land inside CUDA-graph capture
            from cute_kernels.attention import precompile

            precompile(self.kernel_options(kv_cache_spec.dtype), num_kv_heads=self.num_kv_heads)

    def kernel_options(self, dtype) -> tuple[KernelOptions, ...]:
        """Every kernel this builder's steps can launch."""
        return tuple(KernelOptions.for_layer(dtype, self.head_size, self.num_q_heads,
                                             self.num_kv_heads, tm, self.policy.fresh_kv)
                     for tm in self.policy.tile_ms)

    def _device_plan(self, tile_m: int):
        """Persistent device buffers for ``tile_m``-row plans, sized at the planner's worst
        case (split groups: ``worst_case_groups``, which an unpacked split token range of 128
        or 192 tokens, one group per 64 // Gp tokens, needs beyond the unsplit item count)."""
        from cute_kernels.device_plan import DevicePlan

        p = self.policy
        planner = _planner()
        shape = (self.max_num_reqs, self.max_num_tokens, self.max_seq_len_bound,
                 self.num_kv_heads, self.group_size)
        items = planner.worst_case_items(*shape, tile_m=tile_m,
                                         max_splits=self.max_splits if p.allow_split else 1,
                                         fresh_kv=p.fresh_kv, unpacked_prefill=p.unpacked)
        groups = planner.worst_case_groups(*shape) if p.allow_split else 1
        return DevicePlan(item_capacity=max(1, items), group_capacity=max(1, groups),
                          partial_rows_capacity=self.partial_rows, num_ctas=self.num_ctas[tile_m],
                          head_dim=self.head_size, device=self.device, tile_m=tile_m,
                          always_combine=p.allow_split)

    # ------------------------------------------------------------------ planning
    def step_tile_m(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> int:
        """q-tile rows for this step: 64 unless the policy allows wider tiles and the step
        is prefill-dominated (``cute_kernels.cost_model.choose_tile_m``)."""
        if len(self.policy.tile_ms) == 1:
            return self.policy.tile_ms[0]
        from cute_kernels.cost_model import choose_tile_m

        return choose_tile_m(query_start_loc, seq_lens, num_q_heads=self.num_q_heads,
                             num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
                             num_ctas=self.num_ctas[2 * WARPGROUP_ROWS])

    def run_planner(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    tile_m: int = WARPGROUP_ROWS) -> Any:
        """Host plan for one step (``cute_kernels.planner.plan``, docs/contract.md)."""
        p = self.policy
        return _planner().plan(
            query_start_loc, seq_lens, num_kv_heads=self.num_kv_heads,
            group_size=self.group_size, page_size=KERNEL_BLOCK_SIZE,
            num_ctas=self.num_ctas[tile_m], tile_m=tile_m, allow_split=p.allow_split,
            max_splits=self.max_splits,
            max_partial_rows=self.partial_rows,
            fresh_kv=p.fresh_kv, unpacked_prefill=p.unpacked, window=self.window)

    @staticmethod
    def host_seq_lens(common: CommonAttentionMetadata) -> np.ndarray:
        """Host copy of seq_lens, without a device sync when vLLM already has one.

        ``seq_lens_cpu_upper_bound`` is exact except under async speculative decoding,
        where it may run ahead of the device value; the kernel bounds every row by the
        device ``seq_lens`` (causal end), so an over-long page range only costs masked
        pages.
        """
        host = common.seq_lens_cpu_upper_bound
        if host is None:
            host = common._seq_lens_cpu
        if host is None:
            host = common.seq_lens.cpu()
        return np.ascontiguousarray(host[: common.num_reqs].numpy(), dtype=np.int32)

    def step_plan(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> Any:
        """This step's host plan: the last plan of the step's tile size when the batch has
        the same ``plan_reuse_key``, else a new one."""
        tile_m = self.step_tile_m(query_start_loc, seq_lens)
        key = _planner().plan_reuse_key(query_start_loc, seq_lens, page_size=KERNEL_BLOCK_SIZE,
                                        fresh_kv=self.policy.fresh_kv)
        last = self._last_plans.get(tile_m)
        if key is not None and last is not None and last[0] == key:
            self.plans_reused += 1
            return last[1]
        host_plan = self.run_planner(query_start_loc, seq_lens, tile_m)
        self.plans_made += 1
        if key is not None:
            self._last_plans[tile_m] = (key, host_plan)
        return host_plan

    def upload_plan(self, host_plan: Any):
        """Copy ``host_plan`` into the device buffers of its tile size; nothing to copy when
        they already hold this very plan object (``upload`` is their only writer)."""
        dp = self.plans[host_plan.tile_m]
        if dp.host is host_plan:
            return dp
        return dp.upload(host_plan)

    # ------------------------------------------------------------------ build
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> IonAttentionMetadata:
        common = common_attn_metadata
        num_reqs = common.num_reqs
        qsl_host = np.ascontiguousarray(
            common.query_start_loc_cpu[: num_reqs + 1].numpy(), dtype=np.int32)
        host_plan = self.step_plan(qsl_host, self.host_seq_lens(common))
        return IonAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=num_reqs,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
            plan=self.upload_plan(host_plan),
            causal=common.causal,
        )

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False


# --------------------------------------------------------------------------- backend
class IonAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(
        validation.SUPPORTED_KV_CACHE_DTYPES)
    # forward() writes the new K/V itself (cute_kernels.append_sm90).
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[IonAttentionImpl]:
        return IonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[IonAttentionMetadataBuilder]:
        return IonAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # A plain int: vLLM picks 64 when no --block-size is given, and splits a larger
        # multiple of 64 into 64-token kernel pages.
        return [KERNEL_BLOCK_SIZE]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return validation.block_size_reason(block_size) is None

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if block_size != KERNEL_BLOCK_SIZE:
            raise ValueError(f"ION KV pages hold {KERNEL_BLOCK_SIZE} tokens, got block size "
                             f"{block_size}")
        return (num_blocks, 2, num_kv_heads, block_size, head_size)

    @staticmethod
    def get_kv_cache_stride_order(
        include_num_layers_dimension: bool = False,
    ) -> tuple[int, ...]:
        # Physical layout == logical shape; with a layers dimension, layers stay outermost
        # so each layer's cache is one contiguous (num_blocks, 2, Hkv, P, D) tensor.
        if include_num_layers_dimension:
            return (0, 1, 2, 3, 4, 5)
        return (0, 1, 2, 3, 4)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(validation.SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return validation.head_size_reason(head_size) is None

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return validation.dtype_reason(dtype) is None

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str | None) -> bool:
        return validation.kv_cache_dtype_reason(kv_cache_dtype) is None

    @classmethod
    def supports_compute_capability(cls, capability: Any) -> bool:
        return validation.compute_capability_reason(capability) is None

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return validation.attn_type_reason(attn_type) is None

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Per-layer sliding windows, local and global layers mixed (vLLM's hybrid KV
        groups): pruned by the planner, masked at the edge by the kernel."""
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        """gpt-oss's per-head attention sinks (``ion_attention(sinks_log2=)``)."""
        return True

    # MLA, sparse attention, non-causal attention and multimodal prefixes:
    # AttentionBackend's defaults already say no (validation gives the reasons)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """Under ``VLLM_BATCH_INVARIANT=1`` the builder plans without split-KV.  Every output
        row is then reduced by one CTA over its pages in page order, and each wgmma row and
        softmax row depends only on that row's query and keys.  KV tiles that are wholly
        masked for a row (a q tile reaching further than the row) leave its state bit-exact
        (rescale by exp2(0) = 1, p = 0).  So a token's output does not depend on the
        batch, the chunking, or the CTA its work item lands on."""
        return True

    @classmethod
    def validate_configuration(cls, **config: Any) -> list[str]:
        """Every reason ION cannot run vLLM's attention-selector configuration; vLLM 0.26
        passes it by keyword (``validation.backend_config_reasons`` names them all)."""
        return validation.backend_config_reasons(**config)


# --------------------------------------------------------------------------- impl
class IonAttentionImpl(AttentionImpl[IonAttentionMetadata]):
    """One layer: ``ion_attention`` with eager KV writeback, or ``kv_append`` then
    ``ion_attention`` where the builder's policy says so (docs/contract.md)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        if num_kv_heads is None:
            num_kv_heads = num_heads
        validation.check_layer(
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
            kv_cache_dtype=kv_cache_dtype, alibi_slopes=alibi_slopes,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            attn_type=attn_type, has_sinks=sinks is not None)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.softcap = float(logits_soft_cap or 0.0)  # Gemma 2's attention soft cap
        self.window = int(sliding_window or 0)  # tokens; its builder plans with the same
        self.sinks = sinks  # gpt-oss: per-head logits, loaded into this tensor later
        self._sinks_log2 = None  # their kernel form, made at the first forward
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: IonAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query/output: ``[T, Hq, D]``; key/value: ``[T, Hkv, D]``;
        kv_cache: ``[num_blocks, 2, Hkv, 64, D]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ION does not support fused output quantization")
        if attn_metadata is None:
            # Profiling / dummy run without metadata.
            return output.fill_(0)

        kernels = _kernels()
        n = attn_metadata.num_actual_tokens
        if self.sinks is not None and self._sinks_log2 is None:
            # after the weights are loaded (the profile run comes first), before capture
            self._sinks_log2 = kernels.sink_log2(self.sinks)
        k_cache = kv_cache[:, 0]
        v_cache = kv_cache[:, 1]
        plan = attn_metadata.plan
        if plan.fresh_kv:
            # eager writeback: the plan's units read this step's K/V from key/value and the
            # kernel writes them through the block table at positions seq_len - q_len ..,
            # which is what vLLM's slot_mapping holds for these rows
            kernels.ion_attention(
                query[:n], k_cache, v_cache, output[:n], attn_metadata.query_start_loc,
                attn_metadata.seq_lens, attn_metadata.block_table, self.scale, plan=plan,
                key=key[:n], value=value[:n], softcap=self.softcap,
                sinks_log2=self._sinks_log2, window=self.window)
            return output
        if self.kv_sharing_target_layer_name is None and key is not None:
            kernels.kv_append(key[:n], value[:n], k_cache, v_cache,
                              attn_metadata.slot_mapping[:n])
        # q may be a strided view of the fused qkv projection: the kernel reads it by TMA
        # with its row stride, no copy needed
        kernels.ion_attention(
            query[:n], k_cache, v_cache, output[:n], attn_metadata.query_start_loc,
            attn_metadata.seq_lens, attn_metadata.block_table, self.scale, plan=plan,
            softcap=self.softcap, sinks_log2=self._sinks_log2, window=self.window)
        return output


__all__ = ["IonAttentionBackend", "IonAttentionImpl", "IonAttentionMetadata",
    "IonAttentionMetadataBuilder", "StepPolicy"]
