"""ION attention backend for vLLM 0.26's v1 attention interface.

* KV cache: one tensor per layer, ``(num_blocks, 2, num_kv_heads, 64, head_size)`` (HND pages,
  ``k = cache[:, 0]``, ``v = cache[:, 1]``); the physical layout is exactly that shape.
* ``forward`` writes the step's new K/V itself (``cute_kernels.append_sm90``) and then runs
  ``cute_kernels.ion_attention`` over the paged cache (docs/contract.md).  vLLM's own
  cache-write ops are never used.
* The metadata builder plans the step's work list once on the host
  (``cute_kernels.planner.plan``) and copies it into device buffers that are allocated once,
  so CUDA-graph capture / replay keep reading valid pointers.

This module imports torch and vLLM but neither cutlass nor ``cute_kernels`` at import time;
the kernels are imported on first use inside the builder / impl.
"""

from __future__ import annotations

import os
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

from ion_vllm import validation
from ion_vllm.registration import ION_BACKEND_NAME, install_enum_alias

logger = init_logger(__name__)

# vLLM's Attention layer looks its backend up with AttentionBackendEnum[get_name()]; make
# "ION" resolvable in any process that imports this module, even without the plugin hook.
install_enum_alias()

KERNEL_BLOCK_SIZE = validation.KERNEL_BLOCK_SIZE
#: MMA M dimension of one q tile (docs/contract.md: tokens_per_tile = 64 // Gp).
Q_TILE_ROWS = 64

#: ``ION_FUSED_KV_WRITEBACK`` (default 1): the step's new K/V are written into the paged
#: cache inside the attention launch (``ion_attention(..., key=, value=)``, docs/contract.md
#: "Fused KV writeback"), so no separate cache-write kernel runs; 0 restores ``kv_append``
#: + attention.  Default since the H200 run of 2026-12-01 (ninth session: 500/500 sweep
#: cases on 128-row tiles, GPU tests; one layer's launches, fused vs kv_append + attention:
#: decode 32x8192 135.9 vs 138.0 us, prefill 8192 798.5 vs 832.0, mixed 160.4 vs 157.8;
#: end to end with the lane combine, seed 0.996x and skewed 1.025x FLASH_ATTN).  Where the
#: fused path cannot run (batch invariance, 128-token pages, KV-sharing layers) the default
#: falls back to ``kv_append`` with a log line, and an explicit 1 is refused.
FUSED_KV_ENV = "ION_FUSED_KV_WRITEBACK"
#: ``ION_UNPACKED_PREFILL`` (default 1): long prefill rows of padded GQA groups are tiled
#: one q head x 64 tokens (planner ``unpacked_prefill``, docs/contract.md).  On by default
#: since the H200 run of 2026-11-29 (500/500 sweep cases; prefill 8192 at 28/4 heads 983 ->
#: 880 us, mixed 152 -> 149 us, decode unchanged); 0 restores packed-only tiles.
UNPACKED_PREFILL_ENV = "ION_UNPACKED_PREFILL"
#: ``ION_PREFILL_TILE_M`` = ``auto`` (default), ``128`` or ``64``.  ``auto``: a step whose work
#: is prefill MMAs with little decode streaming (``cute_kernels.planner.choose_tile_m``) runs
#: 128-row q tiles on two consumer warpgroups (prefill 8192: 880 -> 814 us), or 192-row tiles
#: on three when its prefill rows make enough of them to balance (``M192_MIN_TILES_PER_CTA``;
#: since 2026-12-02, the fused layer on prefill 8192 879 -> 825 us, FA3 853); ``128``: 64 or
#: 128 only (the ``auto`` before that); every other step, and every uniform-decode step that
#: CUDA graphs capture, runs 64-row tiles.  Only
#: with unpacked prefill tiles, and not under batch invariance or a FULL CUDA-graph mode
#: for mixed batches (where the captured variant could differ at replay).  Fused KV
#: writeback keeps it (its 128-row kernels write the fresh K/V too; since 2026-12-01).
PREFILL_TILE_M_ENV = "ION_PREFILL_TILE_M"
#: ``ION_ROW_COMBINE`` (default 1): split-KV partials are merged by the row-parallel combine
#: kernel (``cute_kernels.combine_sm90.CombineRowsSm90``, one row per warp) instead of the
#: group-per-CTA combine, which walks a group's rows and splits one dependent load at a time.
#: On by default since the H200 run of 2026-11-29 (fourth session): 500/500 sweep cases with
#: splits on every 2nd case, and in one A/B decode 32x8192 143.5 -> 132.8 us, 8x32768
#: 152.6 -> 142.1, skewed 180.0 -> 164.5, 128x2048 129.3 -> 132.3 (bench/notes.md, v6
#: measured); 0 restores the group combine.
ROW_COMBINE_ENV = "ION_ROW_COMBINE"
#: ``ION_LAZY_RESCALE`` (default 0, an experiment): the attention kernels' lazy-rescaling
#: variants (``IonAttentionSm90(lazy_rescale=True)``: a row's running max and O move only
#: when a page raises the max past 2^8 in P; exact like the default).  Correct on the H200
#: (GPU tests, 500/500 sweep cases) but slower there on 2026-12-01: prefill 8192 799 ->
#: 835 us, mixed 148 -> 156 us (bench/notes.md, v10 measured), so it stays off.
LAZY_RESCALE_ENV = "ION_LAZY_RESCALE"
#: ``ION_PDL_COMBINE`` (default 0 until measured on the H200): the split-KV combine is
#: launched with programmatic dependent launch (``CombineSm90(pdl=True)``), so it is
#: scheduled while the attention grid (which triggers at its start) still runs and waits on
#: the GPU (``griddepcontrol.wait``) for that grid to finish: the launch latency between the
#: two kernels hides under the attention's tail.
PDL_COMBINE_ENV = "ION_PDL_COMBINE"
#: ``ION_KV_PAIR`` (default 0, an experiment): the 128-row q tiles of prefill-dominated
#: steps run the page-pair kernels (``IonAttentionSm90(consumers=2, kv_pair=True)``: two
#: 64-token pages per K/V stage, 128 x 128 S tiles), fused writeback included.  Only where
#: 128-row tiles run (``ION_PREFILL_TILE_M=auto``).  Correct on the H200 (GPU tests,
#: 500/500 sweep cases each for the attention and the fused form) but slower there on
#: 2026-12-02: prefill 8192 at full clock 804 -> 825 us (attention), 791 -> 962 us
#: (fused layer) (bench/notes.md, v13 measured), so it stays off.
KV_PAIR_ENV = "ION_KV_PAIR"
#: ``ION_PIN_PV_WAIT`` (default 0 until measured on the H200): the attention kernels wait
#: for their previous O += P V after the softmax in the SASS too
#: (``IonAttentionSm90(pin_pv_wait=True)``): ptxas otherwise moves that wait above the
#: softmax, so a warpgroup's softmax never overlaps its own PV (bench/notes.md, v16).
PIN_PV_WAIT_ENV = "ION_PIN_PV_WAIT"
#: ``ION_VEC_STRADDLE`` (default ``1``): how the fused-writeback kernels copy the
#: fresh-tile rows that reach into the next cache page.  Every fresh tile of a prefill chunk
#: whose context is not a page multiple straddles (in vLLM nearly every continuing chunk),
#: and the element-wise copy stalled the producer warp for ~500 iterations a tile: the
#: engine's prefill steps ran up to 1.4x FA3's time (bench/notes.md, seventeenth and eighteenth
#: sessions).  ``1`` runs the 16-byte-chunk copy (``IonAttentionSm90(vec_straddle=True)``)
#: on every step: since the nineteenth session's mask decision those kernels are as fast
#: or faster where nothing straddles too.  ``0``: the element-wise kernels; ``auto``: the
#: 16-byte kernels on steps with a straddling tile only (the eighteenth session's default).
#: Head size 128 only.
VEC_STRADDLE_ENV = "ION_VEC_STRADDLE"
#: ``ION_SKIP_IDLE`` (default 0, an experiment that lost): on the 128- and 192-row kernels a
#: consumer warpgroup whose rows hold no token of an item (every decode row's tile: 7 of 128
#: or 192 rows are real) issues no wgmma for it (``IonAttentionSm90(skip_idle=True)``).
#: Correct on the H200 (GPU tests), but every engine step of suite ``engine`` ran 20-30%
#: slower with it: with the wgmma inside branches ptxas serializes every wgmma of the kernel
#: (bench/notes.md, eighteenth session), so it stays off.
SKIP_IDLE_ENV = "ION_SKIP_IDLE"
#: ``ION_LANE_COMBINE`` (default 1): split-KV partials are merged by the split-parallel
#: combine (``CombineLanesSm90``: lane s of a row's warp loads split s, and every load of
#: the row is in flight at once), which takes precedence over ``ION_ROW_COMBINE``; 0
#: restores the row combine.  Default since the H200 run of 2026-12-01 (ninth session:
#: GPU tests incl. the >32-split path, 500/500 sweep cases; decode 8x32768 138.8 -> 134.3
#: us, 32x8192 135.9 -> 133.9, skewed 164.1 -> 161.3, in one A/B; bench/notes.md).
LANE_COMBINE_ENV = "ION_LANE_COMBINE"
#: Test-only fault injection (see IonAttentionImpl): ``ION_FAULT_INJECT=swap_kv_page``.
FAULT_INJECT_ENV = "ION_FAULT_INJECT"
#: ``ION_PLAN_REUSE`` (default 1): a step whose batch has the same ``planner.plan_reuse_key``
#: as the last step planned at its tile size reuses that plan, and its device copy when it is
#: still resident, instead of planning and uploading again.  The key is what ``plan`` reads,
#: so the plan is the same one; the saving is host time inside the metadata build, which
#: the GPU waited for on every step (seed, profiled: 224 us a step under ION against 15
#: under FLASH_ATTN between vLLM's input kernels and the forward; bench/notes.md, sixteenth
#: session).  ``0``: plan every step (the A/B baseline).
PLAN_REUSE_ENV = "ION_PLAN_REUSE"
#: ``ION_PLAN_REPAGE`` (default 0 until measured on the H200; needs plan reuse): a decode-only
#: step whose requests are those of the last planned decode-only step, each within
#: ``REPAGE_MAX_DRIFT`` pages of the lengths that plan was made for, runs that plan with its
#: page ranges recomputed (``planner.repage``) instead of a new plan: the same items, CTAs and
#: splits, each request's split ranges cut from its current length.  Unlike plain reuse this
#: runs plans ``plan`` would not have made (still exact attention: every range is covered
#: once), so it waits for its GPU tests and sweep before it can be the default.
PLAN_REPAGE_ENV = "ION_PLAN_REPAGE"
#: ``ION_PLAN_STATS_EVERY=N`` (default 0: off): every N steps the metadata builder logs how
#: many steps ran each q-tile size and how their plans were made (planned, reused,
#: repaged): which kernels a served workload really runs, without a profiler
PLAN_STATS_ENV = "ION_PLAN_STATS_EVERY"
#: pages (KV units) a request may grow past the plan a repaged step reuses
REPAGE_MAX_DRIFT = 2
FAULT_SWAP_KV_PAGE = "swap_kv_page"

_HOPPER_SMS_DEFAULT = 132  # H100/H200 SXM; only used when the builder's device is not CUDA


def _cute_kernels():
    """The two kernels forward() launches, imported on first use (they pull in CuTeDSL)."""
    from types import SimpleNamespace

    from cute_kernels.append_sm90 import kv_append
    from cute_kernels.attention import ion_attention

    return SimpleNamespace(kv_append=kv_append, ion_attention=ion_attention)


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
    plan: Any  # cute_kernels.attention.DevicePlan (the builder's persistent buffers)
    causal: bool | torch.Tensor = True


def fault_block_table(block_table: torch.Tensor) -> torch.Tensor:
    """Test-only fault: a copy of ``block_table`` whose request 0 reads a wrong KV page.

    Page 0 of request 0 is pointed at page 0 of the last request (another sequence's keys
    and values) when the batch has several requests, else pages 0 and 1 are swapped.  Merely
    swapping two fully visible pages would not change attention (RoPE is inside K), so the
    alias to foreign KV is what makes the fault observable end to end.
    """
    broken = block_table.clone()
    if block_table.shape[0] >= 2:
        broken[0, 0] = block_table[-1, 0]
    elif block_table.shape[1] >= 2:
        broken[0, 0:2] = block_table[0, 0:2].flip(0)
    return broken


# --------------------------------------------------------------------------- builder
def _switch(name: str, what: str, default: str = "0") -> bool:
    v = os.environ.get(name, default).strip().lower()
    if v not in ("0", "1", "", "false", "true"):
        raise ValueError(f"{name}={v!r}: use 1 ({what}) or 0")
    return v in ("1", "true")


def fused_kv_writeback() -> bool:
    return _switch(FUSED_KV_ENV, "fused KV writeback", default="1")


def fused_kv_writeback_requested() -> bool:
    """True when ``ION_FUSED_KV_WRITEBACK=1`` is set explicitly (not only the default): then
    a configuration that cannot run it is refused instead of falling back."""
    return FUSED_KV_ENV in os.environ and fused_kv_writeback()


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


def unpacked_prefill() -> bool:
    return _switch(UNPACKED_PREFILL_ENV, "unpacked prefill tiles", default="1")


def row_combine() -> bool:
    return _switch(ROW_COMBINE_ENV, "row-parallel split-KV combine", default="1")


def lazy_rescale() -> bool:
    return _switch(LAZY_RESCALE_ENV, "lazy-rescaling attention kernels")


def pdl_combine() -> bool:
    return _switch(PDL_COMBINE_ENV, "split-KV combine by programmatic dependent launch")


def kv_pair() -> bool:
    return _switch(KV_PAIR_ENV, "page pairs on 128-row q tiles")


def skip_idle() -> bool:
    return _switch(SKIP_IDLE_ENV, "idle consumer warpgroups skip their wgmma")


def vec_straddle():
    """``ION_VEC_STRADDLE`` as a ``DevicePlan(vec_straddle=)`` value: True (unset, ``1``;
    ``attention.VEC_STRADDLE_DEFAULT``), False (``0``) or "auto"."""
    from cute_kernels.attention import VEC_STRADDLE_DEFAULT

    v = os.environ.get(VEC_STRADDLE_ENV, "").strip().lower()
    if v == "":
        return VEC_STRADDLE_DEFAULT
    if v == "auto":
        return "auto"
    if v not in ("0", "1", "false", "true"):
        raise ValueError(f"{VEC_STRADDLE_ENV}={v!r}: use 1 (the 16-byte straddle copy, the "
                         f"default), 0 (element-wise) or auto (16-byte on steps with a "
                         f"straddling tile)")
    return v in ("1", "true")


def pin_pv_wait() -> bool:
    return _switch(PIN_PV_WAIT_ENV, "PV wait pinned after the softmax")


def plan_reuse() -> bool:
    return _switch(PLAN_REUSE_ENV, "plan reuse across steps", default="1")


def plan_repage() -> bool:
    return _switch(PLAN_REPAGE_ENV, "repaged decode plans")


def plan_stats_every() -> int:
    v = os.environ.get(PLAN_STATS_ENV, "0").strip() or "0"
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{PLAN_STATS_ENV}={v!r}: use a step count >= 1, or 0 (off)")
    return n


def lane_combine() -> bool:
    return _switch(LANE_COMBINE_ENV, "split-parallel split-KV combine", default="1")


def prefill_tile_m_setting() -> str:
    """``ION_PREFILL_TILE_M``: ``auto`` (the default: 64, 128 or 192 rows per step), ``128``
    (64 or 128 per step) or ``64``."""
    v = os.environ.get(PREFILL_TILE_M_ENV, "auto").strip().lower() or "auto"
    if v not in ("auto", "128", "64"):
        raise ValueError(f"{PREFILL_TILE_M_ENV}={v!r}: use auto (64, 128 or 192 rows per "
                         "step), 128 (64 or 128) or 64")
    return v


def prefill_tile_m_auto() -> bool:
    """True unless ``ION_PREFILL_TILE_M=64``: steps may run more than 64-row q tiles."""
    return prefill_tile_m_setting() != "64"


def mixed_batches_run_full_graphs(vllm_config) -> bool:
    """Whether vLLM captures mixed prefill/decode batches in FULL CUDA graphs (mode FULL):
    the kernel variant baked into such a graph must not depend on the batch."""
    try:
        from vllm.config import CUDAGraphMode
        mode = vllm_config.compilation_config.cudagraph_mode
        return mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL
    except (AttributeError, ImportError):
        return True  # unknown: assume the strict case


def batch_invariant_mode() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_BATCH_INVARIANT)


class IonAttentionMetadataBuilder(AttentionMetadataBuilder[IonAttentionMetadata]):
    """Builds :class:`IonAttentionMetadata` and the step's work-list plan.

    The plan is computed once per step (not per layer) on the host by
    ``cute_kernels.planner.plan`` from vLLM's host copies of ``query_start_loc`` /
    ``seq_lens`` and uploaded (non-blocking, from pinned buffers) into a
    ``cute_kernels.attention.DevicePlan`` allocated here once at the planner's worst case.
    The kernel runs a fixed persistent grid and reads its whole schedule (work list, split-KV
    workspace, combine groups) from those buffers, and the combine pass is always launched,
    so a captured launch is valid for any later batch: mixed prefill/decode batches can run
    in FULL CUDA graphs.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS
    # The kernel handles mixed prefill + decode in one launch: no batch reordering needed.
    reorder_batch_threshold: int | None = None
    allow_split: ClassVar[bool] = True
    max_splits: ClassVar[int] = 16
    #: split-KV workspace rows (fp32 [rows, D]); the planner only splits within this budget
    partial_rows_per_cta: ClassVar[int] = 4 * Q_TILE_ROWS

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if batch_invariant_mode() and self.allow_split:
            # split-KV sums a row's pages in a batch-dependent grouping: off when vLLM asks
            # for batch-invariant numerics (see IonAttentionBackend.supports_batch_invariance)
            logger.info("ION: VLLM_BATCH_INVARIANT=1, planning without split-KV")
            self.allow_split = False
        #: fused KV writeback: the plan indexes KV units (cache pages + fresh tiles)
        self.fresh_kv = self._fused_kv_writeback(kv_cache_spec, vllm_config)
        #: unpacked prefill tiles (one q head x 64 tokens for long prefill rows, G < Gp)
        self.unpacked = unpacked_prefill()
        if self.unpacked and batch_invariant_mode():
            # the planner unpacks a request only when its cost model says so, which depends
            # on the rest of the batch: a row's tiling must not, under batch invariance
            logger.info_once("ION: VLLM_BATCH_INVARIANT=1, packed prefill tiles only")
            self.unpacked = False
        if not self.unpacked:
            logger.info_once("ION: packed prefill tiles only (%s=0)", UNPACKED_PREFILL_ENV)
        #: 128-row q tiles for prefill-dominated steps (planner.choose_tile_m)
        # (under fused writeback too: the consumers=2 kernels have a fresh_kv form, GPU-tested
        # in tests/test_two_consumers_gpu.py::test_tile_m_128_fused_writeback)
        self.tile_m_auto = (prefill_tile_m_auto() and self.unpacked
                            and not batch_invariant_mode()
                            and not mixed_batches_run_full_graphs(vllm_config))
        #: 192-row q tiles (three consumer warpgroups) for prefill steps with enough tiles
        #: (planner.choose_tile_m(allow_192=True)); not with page pairs (a 128-row option)
        self.tile_m_192 = (self.tile_m_auto and prefill_tile_m_setting() == "auto"
                           and not kv_pair())
        logger.info_once("ION: q tiles of %s rows",
                         ("64, 128 or 192 (per step)" if self.tile_m_192 else
                          "64 or 128 (per step)") if self.tile_m_auto else "64")
        #: row-parallel split-KV combine kernel (default; 0: the group combine)
        self.row_combine = row_combine()
        if not self.row_combine:
            logger.info_once("ION: group split-KV combine (%s=0)", ROW_COMBINE_ENV)
        #: lazy-rescaling attention kernels (an experiment; off by default)
        self.lazy_rescale = lazy_rescale()
        if self.lazy_rescale:
            logger.warning_once("ION: lazy-rescaling attention kernels (%s=1, an experiment; "
                                "slower than the default on the H200)", LAZY_RESCALE_ENV)
        #: split-parallel combine kernel (default; 0: the row combine)
        self.lane_combine = lane_combine()
        if not self.lane_combine:
            logger.info_once("ION: %s split-KV combine (%s=0)",
                             "row" if self.row_combine else "group", LANE_COMBINE_ENV)
        #: page pairs on the 128-row kernels (an experiment; off by default)
        pairs_asked = kv_pair()
        self.kv_pair = pairs_asked and self.tile_m_auto
        if pairs_asked and not self.tile_m_auto:
            logger.warning_once("ION: %s=1 ignored: page pairs run on 128-row q tiles, and "
                                "this configuration runs 64-row tiles only", KV_PAIR_ENV)
        if self.kv_pair:
            logger.info_once("ION: page pairs on 128-row q tiles (%s=1, an experiment)",
                             KV_PAIR_ENV)
        #: the kernels' PV wait pinned after the softmax (off by default until measured)
        self.pin_pv_wait = pin_pv_wait()
        if self.pin_pv_wait:
            logger.info_once("ION: PV wait pinned after the softmax (%s=1, an experiment)",
                             PIN_PV_WAIT_ENV)
        #: the fused kernels' straddle copy: True (default), False or "auto"
        #: (``DevicePlan(vec_straddle=)``; head size 128 only, others keep the element-wise
        #: copy)
        from cute_kernels.attention import check_vec_straddle
        self.vec_straddle = (check_vec_straddle(vec_straddle(), kv_cache_spec.head_size)
                             if self.fresh_kv else False)
        if self.vec_straddle is not False:
            logger.info_once("ION: 16-byte straddle copy of the fused writeback (%s=%s)",
                             VEC_STRADDLE_ENV, self.vec_straddle)
        #: 128/192-row kernels whose idle warpgroups skip wgmma (an experiment that lost; off)
        self.skip_idle = skip_idle()
        if self.skip_idle:
            logger.info_once("ION: idle consumer warpgroups skip their MMAs (%s=1, an "
                             "experiment)", SKIP_IDLE_ENV)
        #: split-KV combine launched with programmatic dependent launch
        self.pdl_combine = pdl_combine()
        if self.pdl_combine:
            logger.info_once("ION: split-KV combine by programmatic dependent launch (%s=1)",
                             PDL_COMBINE_ENV)
        page = validation.kernel_block_size()
        if kv_cache_spec.block_size != page:
            raise ValueError(
                f"ION needs a kernel KV block size of {page}, got "
                f"{kv_cache_spec.block_size}; use --block-size {page}")
        if page != KERNEL_BLOCK_SIZE:
            logger.warning_once("ION: %d-token KV pages (%s, an experiment: its GPU tests "
                                "pass, but it is slower than 64-token pages on the H200)",
                                page, validation.EXPERIMENTAL_PAGE_ENV)
        model_config = vllm_config.model_config
        parallel_config = vllm_config.parallel_config
        scheduler_config = vllm_config.scheduler_config

        self.page_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.num_q_heads = (get_num_attention_heads_from_layers(vllm_config, layer_names)
                            or model_config.get_num_attention_heads(parallel_config))
        self.group_size = self.num_q_heads // self.num_kv_heads

        spec = vllm_config.speculative_config
        num_spec = (spec.num_speculative_tokens or 0) if spec is not None else 0
        if spec is not None and getattr(spec, "parallel_drafting", False):
            num_spec *= 2
        self.max_num_reqs = scheduler_config.max_num_seqs
        self.max_num_tokens = scheduler_config.max_num_batched_tokens
        # seq_lens_cpu_upper_bound may run ahead by the speculative tokens
        self.max_seq_len_bound = model_config.max_model_len + num_spec

        from cute_kernels.attention import ctas_per_sm_for

        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            sms = _HOPPER_SMS_DEFAULT
        self.num_ctas = sms * ctas_per_sm_for(1, self.page_size)
        self.partial_rows = self.partial_rows_per_cta * self.num_ctas if self.allow_split else 0
        self.plan = self._device_plan(Q_TILE_ROWS, self.num_ctas)
        #: tile_m -> (plan_reuse_key, host plan) of the last step planned at that tile size
        self.reuse_plans = plan_reuse()
        self._last_plans: dict[int, tuple[bytes, Any]] = {}
        #: repaged decode plans (ION_PLAN_REPAGE): the base, (new-token counts, units, plan)
        self.repage_plans = self.reuse_plans and plan_repage()
        if plan_repage() and not self.reuse_plans:
            logger.info("ION: %s=1 needs plan reuse (%s=0): off", PLAN_REPAGE_ENV,
                        PLAN_REUSE_ENV)
        self._repage_base: tuple[bytes, np.ndarray, Any] | None = None
        self.plans_repaged = 0
        #: steps planned / steps that reused the previous plan (diagnostics, tests)
        self.plans_made = 0
        self.plans_reused = 0
        #: steps by q-tile rows (64 / 128 / 192), logged every ``plan_stats_every`` steps
        self.steps_by_tile_m: dict[int, int] = {}
        self.plan_stats_every = plan_stats_every()
        self.item_capacity = self.plan.item_capacity
        self.group_capacity = self.plan.group_capacity
        #: tile_m=128 plans: their own buffers (one CTA per SM, so another CTA count)
        self.plan128 = None
        self.num_ctas128 = sms * ctas_per_sm_for(2, self.page_size)
        if self.tile_m_auto:
            self.plan128 = self._device_plan(2 * Q_TILE_ROWS, self.num_ctas128)
        #: tile_m=192 plans: their own buffers too (one CTA per SM, as for 128)
        self.plan192 = None
        if self.tile_m_192:
            self.plan192 = self._device_plan(3 * Q_TILE_ROWS, self.num_ctas128)
        if self.device.type == "cuda":
            # compile + load every kernel now: vLLM's profiling run has no attention metadata,
            # so the first real launch could otherwise land inside CUDA-graph capture
            from cute_kernels.attention import precompile

            precompile(kv_cache_spec.dtype, self.head_size, self.num_q_heads,
                       self.num_kv_heads, self.page_size, fused=self.fresh_kv,
                       unpacked=self.unpacked, consumers=self.consumer_kinds(),
                       row_combine=self.row_combine,
                       experimental_pages=self.page_size != KERNEL_BLOCK_SIZE,
                       lazy_rescale=self.lazy_rescale, pdl_combine=self.pdl_combine,
                       lane_combine=self.lane_combine, kv_pair=self.kv_pair,
                       pin_pv_wait=self.pin_pv_wait, vec_straddle=self.vec_straddle,
                       skip_idle=self.skip_idle)

    @staticmethod
    def _fused_kv_writeback(kv_cache_spec: AttentionSpec, vllm_config: VllmConfig) -> bool:
        """Whether this builder's plans write the step's K/V inside the attention launch
        (``ION_FUSED_KV_WRITEBACK``, default on).  Off, with a log line, where the fused path
        cannot run; an explicit ``ION_FUSED_KV_WRITEBACK=1`` is refused there instead,
        except under batch invariance, which always wins."""
        if not fused_kv_writeback():
            logger.info_once("ION: kv_append + attention (%s=0)", FUSED_KV_ENV)
            return False
        requested = fused_kv_writeback_requested()
        if batch_invariant_mode():
            # fresh tiles start at the chunk's first new token, so a row's KV tiling (and
            # its reduction order) would depend on how the request was chunked
            (logger.warning_once if requested else logger.info_once)(
                "ION: fused KV writeback off under VLLM_BATCH_INVARIANT=1 (fused tiles "
                "depend on chunking); using kv_append")
            return False
        why = None
        if kv_cache_spec.block_size != KERNEL_BLOCK_SIZE:
            why = (f"needs {KERNEL_BLOCK_SIZE}-token pages (got {kv_cache_spec.block_size}, "
                   f"{validation.EXPERIMENTAL_PAGE_ENV})")
        elif model_shares_kv_cache(vllm_config):
            why = "reads each layer's own key/value, and this model has KV-sharing layers"
        if why is not None:
            if requested:
                raise ValueError(f"{FUSED_KV_ENV}=1 {why}; unset {FUSED_KV_ENV}")
            logger.info_once("ION: fused KV writeback %s: using kv_append", why)
            return False
        logger.info_once("ION: fused KV writeback (one launch writes the cache and attends)")
        return True

    def _device_plan(self, tile_m: int, num_ctas: int):
        """Persistent device buffers for this builder's plans of ``tile_m`` q-tile rows,
        sized at the planner's worst case (split groups: ``worst_case_groups``, which an
        unpacked split token range of 128 or 192 tokens, one group per 64 // Gp tokens,
        needs beyond the unsplit item count)."""
        from cute_kernels.attention import DevicePlan

        def bound(max_splits: int, **options) -> int:
            return max(1, _planner().worst_case_items(
                self.max_num_reqs, self.max_num_tokens, self.max_seq_len_bound,
                self.num_kv_heads, self.group_size, page_size=self.page_size,
                tile_m=tile_m, max_splits=max_splits, **options))

        return DevicePlan(
            item_capacity=bound(self.max_splits if self.allow_split else 1,
                                fresh_kv=self.fresh_kv, unpacked_prefill=self.unpacked),
            group_capacity=max(1, _planner().worst_case_groups(
                self.max_num_reqs, self.max_num_tokens, self.max_seq_len_bound,
                self.num_kv_heads, self.group_size,
                page_size=self.page_size)) if self.allow_split else 1,
            partial_rows_capacity=self.partial_rows, num_ctas=num_ctas,
            head_dim=self.head_size, device=self.device, always_combine=self.allow_split,
            unpacked=self.unpacked, tile_m=tile_m, row_combine=self.row_combine,
            page_size=self.page_size, lazy_rescale=self.lazy_rescale,
            pdl_combine=self.pdl_combine, lane_combine=self.lane_combine,
            kv_pair=self.kv_pair and tile_m == 2 * Q_TILE_ROWS,
            pin_pv_wait=self.pin_pv_wait, vec_straddle=self.vec_straddle,
            skip_idle=self.skip_idle and tile_m > Q_TILE_ROWS)

    def consumer_kinds(self) -> tuple[int, ...]:
        """Consumer warpgroup counts of the attention kernels this builder's plans run."""
        return (1,) + ((2,) if self.tile_m_auto else ()) + ((3,) if self.tile_m_192 else ())

    # ------------------------------------------------------------------ planning
    def step_tile_m(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> int:
        """q-tile rows for this step: 64, or 128 (192 with ``tile_m_192`` when the prefill
        rows make enough tiles) when ``tile_m_auto`` and the step is prefill-dominated
        (``cute_kernels.planner.choose_tile_m``)."""
        if not self.tile_m_auto:
            return Q_TILE_ROWS
        return _planner().choose_tile_m(
            query_start_loc, seq_lens, num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_size,
            allow_192=self.tile_m_192, num_ctas=self.num_ctas128)

    def run_planner(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
                    tile_m: int = Q_TILE_ROWS) -> Any:
        """Host plan for one step (``cute_kernels.planner.plan``, docs/contract.md)."""
        m128 = tile_m in (2 * Q_TILE_ROWS, 3 * Q_TILE_ROWS)  # one CTA per SM
        return _planner().plan(
            query_start_loc, seq_lens,
            num_kv_heads=self.num_kv_heads, group_size=self.group_size,
            page_size=self.page_size,
            num_ctas=self.num_ctas128 if m128 else self.num_ctas, tile_m=tile_m,
            allow_split=self.allow_split, max_splits=self.max_splits,
            max_partial_rows=self.partial_rows,
            fresh_kv=self.fresh_kv, unpacked_prefill=self.unpacked)

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

    def upload_plan(self, host_plan: Any):
        """Copy ``host_plan`` into the persistent device buffers of its tile size (in place);
        nothing to copy when those buffers already hold this very plan object (a reused
        plan: ``upload`` is the only writer of the buffers, and it records the plan it
        wrote as ``DevicePlan.host``)."""
        tile_m = getattr(host_plan, "tile_m", Q_TILE_ROWS)
        if tile_m == 3 * Q_TILE_ROWS:
            dp = self.plan192
        elif tile_m == 2 * Q_TILE_ROWS:
            dp = self.plan128
        else:
            dp = self.plan
        if dp.host is host_plan:
            return dp
        return dp.upload(host_plan)

    def step_plan(self, query_start_loc: np.ndarray, seq_lens: np.ndarray) -> Any:
        """This step's host plan: the last plan of the step's tile size when the batch has
        the same ``plan_reuse_key`` (so ``run_planner`` would return an equal plan); under
        ``ION_PLAN_REPAGE`` the last decode-only plan recut for a decode-only step of the
        same requests (``_repaged``); else a new one."""
        tile_m = self.step_tile_m(query_start_loc, seq_lens)
        key = None
        if self.reuse_plans:
            key = _planner().plan_reuse_key(query_start_loc, seq_lens,
                                            page_size=self.page_size, fresh_kv=self.fresh_kv)
            last = self._last_plans.get(tile_m)
            if key is not None and last is not None and last[0] == key:
                self.plans_reused += 1
                return last[1]
        dec = None
        if self.repage_plans and tile_m == Q_TILE_ROWS:
            dec = _planner().decode_units(query_start_loc, seq_lens, page_size=self.page_size,
                                          fresh_kv=self.fresh_kv)
            host_plan = self._repaged(dec)
            if host_plan is not None:
                self.plans_repaged += 1
                self._last_plans[tile_m] = (key, host_plan)
                return host_plan
        host_plan = self.run_planner(query_start_loc, seq_lens, tile_m)
        self.plans_made += 1
        if key is not None:
            self._last_plans[tile_m] = (key, host_plan)
        if dec is not None:
            self._repage_base = (dec[0], dec[1], host_plan)
        return host_plan

    def _count_step(self, tile_m: int) -> None:
        self.steps_by_tile_m[tile_m] = self.steps_by_tile_m.get(tile_m, 0) + 1
        n = self.plan_stats_every
        if n and sum(self.steps_by_tile_m.values()) % n == 0:
            logger.info("ION: %d steps by q-tile rows %s; plans made %d, reused %d, "
                        "repaged %d", sum(self.steps_by_tile_m.values()),
                        dict(sorted(self.steps_by_tile_m.items())), self.plans_made,
                        self.plans_reused, self.plans_repaged)

    def _repaged(self, dec) -> Any:
        """The repage base plan cut for this decode-only step (``dec``: its
        ``planner.decode_units``), or None when the step's requests are not the base's or
        have moved more than ``REPAGE_MAX_DRIFT`` pages from it."""
        base = self._repage_base
        if dec is None or base is None or dec[0] != base[0]:
            return None
        units = dec[1]
        if units.shape != base[1].shape or int(np.abs(units - base[1]).max(initial=0)) > (
                REPAGE_MAX_DRIFT):
            return None
        try:
            return _planner().repage(base[2], units, group_size=self.group_size,
                                     page_size=self.page_size)
        except ValueError:  # fewer pages than splits: plan it
            return None

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
        sl_host = self.host_seq_lens(common)
        host_plan = self.step_plan(qsl_host, sl_host)
        self._count_step(getattr(host_plan, "tile_m", Q_TILE_ROWS))
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
        return ION_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[IonAttentionImpl]:
        return IonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[IonAttentionMetadataBuilder]:
        return IonAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # A plain int: vLLM picks 64 when no --block-size is given, and splits a larger
        # multiple of 64 into 64-token kernel pages (128 under ION_EXPERIMENTAL_PAGE=128).
        return [validation.kernel_block_size()]

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
        page = validation.kernel_block_size()
        if block_size != page:
            raise ValueError(f"ION KV pages hold {page} tokens, got block size {block_size}")
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
    def is_mla(cls) -> bool:
        return False

    @classmethod
    def is_sparse(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

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
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: Any,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
    ) -> list[str]:
        return validation.backend_config_reasons(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
            block_size=block_size, use_mla=use_mla, has_sink=has_sink,
            use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales,
            device_capability=device_capability, attn_type=attn_type,
            has_sliding_window=has_sliding_window, use_non_causal=use_non_causal,
            use_batch_invariant=use_batch_invariant, use_kv_connector=use_kv_connector,
            use_pcp=use_pcp)


# --------------------------------------------------------------------------- impl
class IonAttentionImpl(AttentionImpl[IonAttentionMetadata]):
    """Runs ``kv_append`` then ``ion_attention`` (docs/contract.md) for one layer.

    Test-only: with ``ION_FAULT_INJECT=swap_kv_page`` in the environment when the layer is
    built, the block table handed to the attention kernel has request 0's first two KV pages
    swapped, so attention reads the wrong keys/values (the cache writes stay correct).  It
    exists so an end-to-end test can prove it fails when attention is broken; never set it
    in production.
    """

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
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if kv_sharing_target_layer_name is not None and fused_kv_writeback_requested():
            raise ValueError(
                f"ION: {FUSED_KV_ENV}=1 reads each step's K/V from the layer's own key/value, "
                f"but layer shares the KV cache of {kv_sharing_target_layer_name!r}; unset "
                f"{FUSED_KV_ENV}")
        fault = os.environ.get(FAULT_INJECT_ENV, "")
        if fault not in ("", FAULT_SWAP_KV_PAGE):
            raise ValueError(f"{FAULT_INJECT_ENV}={fault!r}: the only test fault is "
                             f"{FAULT_SWAP_KV_PAGE!r}")
        self.fault_swap_kv_page = fault == FAULT_SWAP_KV_PAGE
        if self.fault_swap_kv_page:
            logger.warning_once("%s=%s: ION attention is deliberately WRONG (test-only "
                                "fault injection)", FAULT_INJECT_ENV, fault)

    def kernel_block_table(self, attn_metadata: IonAttentionMetadata) -> torch.Tensor:
        if self.fault_swap_kv_page:
            return fault_block_table(attn_metadata.block_table)
        return attn_metadata.block_table

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
        kv_cache: ``[num_blocks, 2, Hkv, P, D]`` (P = 64, or 128 under ION_EXPERIMENTAL_PAGE)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ION does not support fused output quantization")
        if attn_metadata is None:
            # Profiling / dummy run without metadata.
            return output.fill_(0)

        kernels = _cute_kernels()
        n = attn_metadata.num_actual_tokens
        k_cache = kv_cache[:, 0]
        v_cache = kv_cache[:, 1]
        writes_kv = self.kv_sharing_target_layer_name is None and key is not None
        if attn_metadata.plan.fresh_kv:
            # fused KV writeback: the plan's units read this step's K/V from key/value, so
            # they must be passed even when this layer shares another layer's cache
            if not writes_kv:
                raise NotImplementedError(
                    f"{FUSED_KV_ENV}=1 does not support KV-sharing layers; unset it")
            # the kernel writes through the block table at positions seq_len - q_len ..,
            # which is what vLLM's slot_mapping holds for these rows
            kernels.ion_attention(
                query[:n], k_cache, v_cache, output[:n],
                attn_metadata.query_start_loc, attn_metadata.seq_lens,
                self.kernel_block_table(attn_metadata), self.scale,
                plan=attn_metadata.plan, key=key[:n], value=value[:n])
            return output
        if writes_kv:
            kernels.kv_append(key[:n], value[:n], k_cache, v_cache,
                              attn_metadata.slot_mapping[:n])
        # q may be a strided view of the fused qkv projection: the kernel reads it by TMA
        # with its row stride, no copy needed
        kernels.ion_attention(
            query[:n], k_cache, v_cache, output[:n],
            attn_metadata.query_start_loc, attn_metadata.seq_lens,
            self.kernel_block_table(attn_metadata), self.scale,
            plan=attn_metadata.plan,
            experimental_pages=attn_metadata.plan.page_size != KERNEL_BLOCK_SIZE)
        return output


__all__ = [
    "IonAttentionBackend",
    "IonAttentionImpl",
    "IonAttentionMetadata",
    "IonAttentionMetadataBuilder",
    "fault_block_table",
]
