"""IonAttention forward kernel for Hopper (sm_90a), written in CuTeDSL.

One launch covers every row of a mixed prefill + decode batch over the paged KV cache.

Work decomposition (see docs/contract.md): the host-side planner emits a work list; CTA ``c``
walks items ``cta_offsets[c] : cta_offsets[c+1]``.  An item is one (request, KV head, q tile,
KV page range).  A q tile packs ``tokens_per_tile = 64 // Gp`` new tokens times ``Gp`` q heads
(the q heads that share one KV head, padded to a power of two) into the 64-row M dimension of
the wgmma, so a decode row with GQA 7 fills 7 of 8 rows per token instead of 1 of 64.

CTA layout (256 threads, two warpgroups):
  * warpgroup 0 -- producer.  Warp 0 issues TMA (``cp.async.bulk.tensor``) loads: the packed Q
    box (Gp heads x tokens_per_tile tokens x D) and, per KV page, one K box and one V box
    (``page x D``: one page of one KV head is exactly one TMA box in the ION HND layout).
    Loads complete on mbarriers of three shared-memory pipelines (Q, K and V, two stages
    each by default), so the producer runs up to two pages ahead of the math.  (128-token
    pages use one K/V stage, ``kv_stages=1``, so that two CTAs fit per SM; see
    ``attention.kv_stages_for``.  With one stage the producer issues K_{p+1} before V_p.)
  * warpgroup 1 -- consumer.  S = Q K^T on wgmma (A and B from shared memory), online softmax
    in fp32 registers (exp2, causal / length masking on boundary pages only), P converted to
    16-bit in registers and O += P V on wgmma (A from registers, B = V from shared memory),
    then O / l stored to global memory for the valid rows.  Software pipelined: S_{j+1} is
    issued before O += P_j V_j, and the softmax of S_{j+1} runs while that PV is on the tensor
    cores; O is rescaled once the PV has retired.
Two CTAs share an SM (``setmaxnreg`` 24 / 232), so one CTA's softmax also hides behind the
other's MMAs.
Split-KV items (work col 7 > 1, ``partial_offsets[item] >= 0``) write their O / l in fp32 and
their log2-sum-exp to a workspace instead; ``combine_sm90.py`` merges the splits exactly.

Fused KV writeback (``fresh_kv=True``, entry point ``IonAttentionSm90.fused``; with False
the generated code is exactly the plain kernel above).  Work cols 4/5 then index KV *units*
(planner ``fresh_kv=True``): with ``ctx = seq_len - q_len`` (tokens cached before this step)
units ``0 .. n_old-1`` (``n_old = ceil(ctx / P)``) are cache pages, loaded as above, and unit
``n_old + k`` is *fresh tile* k: key positions ``ctx + k*P ..``, loaded by TMA straight from
the step's new K/V (``[T, Hkv, D]``, rows ``qsl[b] + k*P ..``; rows past T are zero-filled).
Masks: old-page keys are valid iff ``< ctx``, fresh keys iff ``<=`` the query's position.
The one item owning fresh tile k (``planner.fresh_tile_owned``: its q tile holds new token
``min(k*P + P-1, q_len-1)``) has the producer wait on the stage's full barrier and TMA-store
the K and V tiles from shared memory into the cache: page ``pos // P`` at row offset
``pos % P`` (``pos = ctx + k*P``; tile rows past the page are clipped by the TMA bounds).
When valid rows reach into the next page, the producer warp copies those rows (tile rows
``P - pos % P ..``) into rows ``0 ..`` of that page with plain stores: a TMA store there would
need a negative row coordinate, which the H200 rejects (``cudaErrorIllegalInstruction``).
Only prefill chunks whose context is not page-aligned straddle; decode tiles never do.
(``vec_straddle=True``: that copy moves 16-byte chunks, ``STRADDLE_BATCH`` loads then as
many stores a lane an iteration, instead of one element; ``DevicePlan`` runs these kernels
at the head sizes of ``attention.VEC_STRADDLE_HEAD_DIMS``, on every fused plan by default.)
Before a stage is refilled the producer waits for the store that read it
(``cp.async.bulk.wait_group.read``)
and before exit for all stores (``cp.async.bulk.wait_group 0``).  No item reads the fresh
region from the cache, so there is no cross-CTA ordering.

Unpacked prefill tiles (``unpacked_prefill=True``; with False the generated code is the
kernel above).  Work col 8 (``W_QHEAD``) = -1 marks a packed item as above; g >= 0 marks an
*unpacked* item: ONE q head ``h * G + g`` times 64 consecutive new tokens (planner
``unpacked_prefill=True``, used for long prefill rows when G < Gp so no MMA row is GQA
padding).  The producer loads its Q tile with a second TMA atom, box (1 head, 64 tokens, D)
of the same (head, token, d) view, into the same smem Q stage (row r = token r); the
consumer maps row -> token with a runtime shift (``row >> log2(Gp)`` packed, ``row``
unpacked) for the causal mask and the output store (row r -> token q_start + r, head
h*G + g; rows past the tile's token count are not stored).  A split unpacked item (v18)
writes its partial rows in the chunked packed layout of ``planner.partial_row`` (chunks of
64 // Gp tokens, each a packed-layout combine group; ``poff`` holds the block base plus its
q head, and the row adds the chunk, split index and token), so the combine pass is the
packed one.  With ``fresh_kv`` too, of the G unpacked
items holding a fresh tile's owner token only g == 0 stores it (``planner.fresh_tile_owned``).

Two consumer warpgroups (``consumers=2``; with 1 the generated code is the kernel above):
128-row q tiles (planner ``tile_m=128``), 384 threads, one CTA per SM.  Warpgroup 0 produces
as above but loads a Q stage as two 64-row boxes (buffers ``2*stage`` and ``2*stage + 1``);
warpgroup ``w`` = 1, 2 consumes buffer ``2*stage + w - 1`` and the SAME K/V stages: every
empty barrier counts the 4 warps of both consumers (8 arrivals).  Consumer ``w`` sees its
half as a 64-row tile whose first token is ``(64*(w-1)) >> shift`` tokens into the item
(mask, output rows, partial rows ``+ 64*(w-1)``; an unpacked item's ``+ 64*(w-1)*Gp``), so
the helpers are unchanged.  With ``skip_idle=True`` a consumer whose half holds no token of
the item (a decode row's tile, a chunk's tail) waits on and releases every stage as usual
but issues no wgmma.

Page pairs (``kv_pair=True``, consumers=2 only; with False the generated code is the kernel
above): a K/V stage holds two consecutive pages of an item, loaded as two TMA boxes into
its halves on the stage's one barrier, so S = Q K^T covers 128 keys (m64n128k16 wgmma) and
the softmax reductions, O rescale and pipeline waits run once per 128 keys.  An item with
an odd page count loads its last page into both halves; the consumer masks keys past
``min(seq_len, p1 * P)``, which drops the copy.

Warpgroup ping-pong (``pingpong=True``, consumers=2 only; with False the generated code is
the kernel above): the two consumer warpgroups take turns issuing their MMAs, through two
named barriers (ids ``PINGPONG_BARRIER``, ``+1``; 256 threads each).  Warpgroup ``w``
waits on barrier ``w - 1`` before it issues the S = Q K^T of an item's first page and
before each steady-state S_p + O += P_{p-1} V_{p-1} pair, and arrives on the other
warpgroup's barrier right after issuing; warpgroup 1 arrives on its own barrier once at
start, so it goes first.  The final O += P V of an item is outside the turn.  Both
warpgroups walk the same items and pages, so every wait is matched by one arrive.  The
intent, as in FA3 on Hopper (its "warp scheduler barriers"): the tensor cores see one
warpgroup's MMAs, then the other's, and each warpgroup's softmax runs while the other's
MMAs execute.  An experiment: on the H200 it is correct and 2-5% slower on prefill, so the
warpgroups were not stalling in lockstep without it (``attention.PINGPONG_DEFAULT``;
bench/notes.md, v15).

Pinned PV wait (``pin_pv_wait=True``; with False the generated code is the kernel above).
The steady state is written so that the softmax of S_p runs while O += P_{p-1} V_{p-1} is
on the tensor cores: ``wgmma.wait_group 0`` (that PV's retirement) comes after the
softmax in the PTX.  ptxas moves it up anyway: in the SASS of every variant (and of FA3's
causal hdim-128 kernel) ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` sits right after the mask,
before the row reductions and every exp2, so a warpgroup waits for its own PV before its
softmax.  With the option the wait sits in both arms of a branch on the softmax's row
sum (``row_sum >= 0 or group_size > 0``: true in every thread, so the warpgroup stays
converged as ``wgmma.wait_group`` requires; both arms wait).  ptxas does not move the
wait across that branch, so it stays after the exp2s (``scripts/sass_profile.py
--pin-pv-wait on``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

TILE_M = 64
#: 16-byte chunks a producer lane loads before it stores them (``vec_straddle``)
STRADDLE_BATCH = 4
#: lazy_rescale: a row's running max moves only when a page raises it by more than this many
#: log2 units of the scaled score (P <= 2^8 in between; the threshold FA4 uses)
LAZY_RESCALE_LOG2 = 8.0
LOG2_E = 1.4426950408889634
#: pingpong: first of the two named-barrier ids the consumer warpgroups take turns on
#: (id 0 is the CTA-wide barrier; no other named barrier is used)
PINGPONG_BARRIER = 1

# work-list columns (docs/contract.md)
W_REQ, W_HEAD, W_QSTART, W_QLEN, W_P0, W_P1, W_SPLIT, W_NSPLIT, W_QHEAD = range(9)
WORK_COLS = 9


class IonAttentionSm90:
    """Compile-time configuration of one kernel variant.

    ``dtype``: cutlass.BFloat16 or cutlass.Float16.  ``head_dim``: 64 or 128.
    ``group_pad``: G rounded up to a power of two (1, 2, 4, 8).  ``page_size``: KV page = KV tile.
    """

    def __init__(self, dtype, head_dim: int, group_pad: int, page_size: int = 64,
                 kv_stages: int = 2, q_stages: int = 2, ctas_per_sm=None,
                 fresh_kv: bool = False, unpacked_prefill: bool = False, consumers: int = 1,
                 lazy_rescale: bool = False, kv_pair: bool = False, pingpong: bool = False,
                 pin_pv_wait: bool = False, vec_straddle: bool = False,
                 skip_idle: bool = False):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if group_pad not in (1, 2, 4, 8):
            raise ValueError(f"group_pad must be 1, 2, 4 or 8, got {group_pad}")
        if page_size not in (64, 128):
            raise ValueError(f"page_size must be 64 or 128, got {page_size}")
        if consumers not in (1, 2, 3):
            raise ValueError(f"consumers must be 1, 2 or 3, got {consumers}")
        if ctas_per_sm is None:
            ctas_per_sm = 2 if consumers == 1 else 1
        if consumers >= 2 and ctas_per_sm != 1:
            raise ValueError(f"consumers={consumers} ({128 * (1 + consumers)} threads, "
                             f"{64 * consumers}-row q tiles) runs one CTA per SM: "
                             f"ctas_per_sm must be 1, got {ctas_per_sm}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.group_pad = group_pad
        # consumer warpgroups: 1 = 64-row q tiles (default); 2 = 128-row q tiles, consumer
        # warpgroup w (1, 2) computes rows 64*(w-1) .. +63, both share every K/V stage
        self.consumers = consumers
        self.tile_rows = TILE_M * consumers
        # tokens of a packed q tile (planner tile_m = self.tile_rows)
        self.tokens_per_tile = self.tile_rows // group_pad
        self.page = page_size
        self.kv_stages = kv_stages
        self.q_stages = q_stages
        # 64-row Q buffers in shared memory: one per consumer warpgroup per Q stage
        self.q_bufs = q_stages * consumers
        self.threads = 128 * (1 + consumers)
        # two CTAs per SM: 2 x 256 threads share the 64K-register file, so per CTA
        # 128 x 24 (producer) + 128 x 232 (consumer) = 32768 registers
        self.ctas_per_sm = ctas_per_sm
        self.producer_regs = 24
        self.consumer_regs = 232 if ctas_per_sm == 2 else 240
        # fused KV writeback (docs/contract.md, "Fused KV writeback"): work cols 4/5 are KV
        # units, fresh tiles are read from the step's new K/V and TMA-stored into the cache.
        # Compile-time: with False the generated code is the plain paged-attention kernel.
        self.fresh_kv = bool(fresh_kv)
        # fresh_kv only: the straddle copy (the rows of a fresh tile that reach into the
        # next page) moves STRADDLE_BATCH 16-byte chunks (8 elements of a row each) a lane
        # an iteration instead of one element; with False the generated code is the
        # element-wise copy.  At D = 64 the 40-register producer spills with the 128-bit
        # copy, so those kernels give the producer 48 (below); which head sizes plans run
        # it at is ``attention.VEC_STRADDLE_HEAD_DIMS`` (tests/test_fused_writeback_cpu.py)
        self.vec_straddle = bool(vec_straddle) and self.fresh_kv
        # consumers >= 2 only: a consumer warpgroup whose rows hold no token of the item (a
        # decode row's tile at 128 or 192 rows, the tail tile of a chunk) issues no wgmma
        # for it and only paces the K/V pipelines; with False the generated code computes
        # every row
        self.skip_idle = bool(skip_idle) and consumers >= 2
        if self.fresh_kv:
            # the writeback producer keeps the unit / ownership state of an item live:
            # with 24 (or 32) registers ptxas spills it to local memory (D = 64 variants),
            # 40 / 216 compiles every variant spill-free (tests/test_fused_writeback_cpu.py)
            self.producer_regs = 40
            self.consumer_regs = 216 if ctas_per_sm == 2 else 240
        if consumers == 2:
            # one CTA of 384 threads per SM (entry budget 168 registers a thread):
            # 128 x 24 + 256 x 240 = 128 x 40 + 256 x 232 = 64512 <= 65536
            self.producer_regs = 40 if self.fresh_kv else 24
            self.consumer_regs = 232 if self.fresh_kv else 240
        if consumers == 3:
            # one CTA of 512 threads per SM (entry budget 128 registers a thread):
            # 128 x 40 + 384 x 144 = 60416 <= 65536.  144 rather than the 152-160 that fit:
            # with more, ptxas rematerializes the steady state's exp2s in some D = 128
            # variants (66 FFMA + MUFU.EX2 a page instead of 34; at 160 the plain unpacked
            # kernel ran 15% slower than the 128-row one on the H200, bench/notes.md v17);
            # at 144 every D = 128 variant issues 34, spill-free (tests pin it).  The D = 64
            # variants issue 66 at any budget from 136 to 160.
            self.producer_regs = 40 if self.fresh_kv else 24
            self.consumer_regs = 144
        if self.vec_straddle and head_dim == 64:
            # the 128-bit straddle copy at D = 64: ptxas spills the 40-register producer
            # (9-10 STL at any batch, even one chunk a lane) and not a 48-register one; the
            # consumers give up 8 (2 CTAs: 128 x 48 + 128 x 208 = 32768; 2 consumers:
            # 128 x 48 + 256 x 224 = 63488 <= 384 x 168 at entry; 3: 128 x 48 + 384 x 144
            # = 61440), with the same steady state (68 / 100 MUFU.EX2, no spills; the
            # D = 64 consumer holds half D = 128's O accumulator)
            self.producer_regs = 48
            if consumers == 1 and ctas_per_sm == 2:
                self.consumer_regs = 208
            elif consumers == 2:
                self.consumer_regs = 224
        # unpacked prefill tiles (work col 8 >= 0): a second Q TMA atom (1 head x 64 tokens)
        # and a runtime row -> token shift.  Compile-time: with False the code is unchanged.
        self.unpacked = bool(unpacked_prefill)
        self.log2_gp = group_pad.bit_length() - 1
        # lazy rescaling (an experiment, off by default): a row keeps its running max until
        # a page raises it by more than LAZY_RESCALE_LOG2 (log2 units of the scaled score),
        # and O is rescaled only when some row of the thread moved its max.  Exact: O, the
        # row sum and the split-KV lse all refer to the same (stale) max; P stays <= 2^8.
        # Compile-time: with False the generated code is unchanged.
        self.lazy_rescale = bool(lazy_rescale)
        # page pairs (an experiment aimed at the prefill gap): one K/V stage holds two
        # consecutive pages of an item, so S = Q K^T is a 64 x 128 tile (m64n128k16 wgmma)
        # and the per-tile softmax row reductions, O rescale and barrier round trips are
        # paid once per 128 keys instead of per 64.  Only on the 128-row, two-consumer
        # kernel: it already runs one CTA per SM, and two stages of 128-key K and V
        # (128 KiB) plus its Q stages (64 KiB) fit in one SM's shared memory, so unlike
        # 128-token pages (bench/notes.md, v7) no second CTA is lost.  An item with an odd
        # page count loads its last page into both halves of its last stage; the second
        # copy's keys sit past the item's end (p1 * P) and are masked.  Measured on the H200
        # (2026-12-02, bench/notes.md v13): correct, but at full clock 2.5% slower than
        # 64-key tiles on prefill, and 22% slower with fused writeback.
        # Compile-time: with False the generated code is unchanged.
        self.kv_pair = bool(kv_pair)
        if self.kv_pair:
            if consumers != 2:
                raise ValueError("kv_pair (two pages per K/V stage) needs consumers=2 "
                                 f"(128-row q tiles, one CTA per SM), got consumers={consumers}")
            if page_size != 64 or kv_stages != 2:
                raise ValueError("kv_pair pairs 64-token pages on two K/V stages, got "
                                 f"page_size={page_size}, kv_stages={kv_stages}")
        # warpgroup ping-pong (module docstring): the two consumer warpgroups issue their MMAs
        # in turns.  Compile-time: with False the generated code is unchanged.
        self.pingpong = bool(pingpong)
        if self.pingpong and consumers != 2:
            raise ValueError("pingpong alternates two consumer warpgroups: it needs "
                             f"consumers=2, got consumers={consumers}")
        # pinned PV wait (module docstring): the steady state's wait for O += P V stays after
        # the softmax in the SASS.  Compile-time: with False the generated code is unchanged.
        self.pin_pv_wait = bool(pin_pv_wait)
        #: pages per K/V stage and keys per S tile
        self.pages_per_tile = 2 if self.kv_pair else 1
        self.kv_tile = page_size * self.pages_per_tile

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,          # [T, Hq, D]
        mK: cute.Tensor,          # [NB, Hkv, P, D] (view)
        mV: cute.Tensor,          # [NB, Hkv, P, D] (view)
        mO: cute.Tensor,          # [T, Hq, D]
        mQSL: cute.Tensor,        # int32 [B+1]
        mSeqLens: cute.Tensor,    # int32 [B]
        mBlockTable: cute.Tensor,  # int32 [B, max_pages]
        mWork: cute.Tensor,       # int32 [N, 8]
        mOffsets: cute.Tensor,    # int32 [C+1]
        mPartialOffsets: cute.Tensor,  # int32 [N]: first partial row of a split item, -1 if unsplit
        mOPartial: cute.Tensor,   # fp32 [R, D]: split-KV partial outputs (normalised by own l)
        mLsePartial: cute.Tensor,  # fp32 [R]: split-KV partial log2-sum-exp (scaled units)
        group_size: cutlass.Int32,
        softmax_scale_log2: cutlass.Float32,
        num_ctas: cutlass.Int32,
        stream,
    ):
        if cutlass.const_expr(self.fresh_kv):
            raise TypeError("a fresh_kv IonAttentionSm90 is compiled through .fused(...)")
        self._host(mQ, mK, mV, mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets,
                   mPartialOffsets, mOPartial, mLsePartial, group_size, softmax_scale_log2,
                   num_ctas, stream, None, None)

    @cute.jit
    def fused(
        self,
        mQ: cute.Tensor,          # [T, Hq, D]
        mKey: cute.Tensor,        # [T, Hkv, D]: the step's new K, rows aligned with mQ
        mValue: cute.Tensor,      # [T, Hkv, D]: the step's new V
        mK: cute.Tensor,          # [NB, Hkv, P, D] (view): new K rows are written here
        mV: cute.Tensor,          # [NB, Hkv, P, D] (view): new V rows are written here
        mO: cute.Tensor,
        mQSL: cute.Tensor,
        mSeqLens: cute.Tensor,
        mBlockTable: cute.Tensor,
        mWork: cute.Tensor,       # int32 [N, 8], cols 4/5 = KV units (planner fresh_kv=True)
        mOffsets: cute.Tensor,
        mPartialOffsets: cute.Tensor,
        mOPartial: cute.Tensor,
        mLsePartial: cute.Tensor,
        group_size: cutlass.Int32,
        softmax_scale_log2: cutlass.Float32,
        num_ctas: cutlass.Int32,
        stream,
    ):
        """Attention + eager KV writeback in one launch (``fresh_kv=True`` only)."""
        if cutlass.const_expr(not self.fresh_kv):
            raise TypeError("IonAttentionSm90.fused needs fresh_kv=True")
        self._host(mQ, mK, mV, mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets,
                   mPartialOffsets, mOPartial, mLsePartial, group_size, softmax_scale_log2,
                   num_ctas, stream, mKey, mValue)

    @cute.jit
    def _host(
        self,
        mQ: cute.Tensor,          # [T, Hq, D]
        mK: cute.Tensor,          # [NB, Hkv, P, D] (view)
        mV: cute.Tensor,          # [NB, Hkv, P, D] (view)
        mO: cute.Tensor,          # [T, Hq, D]
        mQSL: cute.Tensor,        # int32 [B+1]
        mSeqLens: cute.Tensor,    # int32 [B]
        mBlockTable: cute.Tensor,  # int32 [B, max_pages]
        mWork: cute.Tensor,       # int32 [N, 8]
        mOffsets: cute.Tensor,    # int32 [C+1]
        mPartialOffsets: cute.Tensor,  # int32 [N]: first partial row of a split item, -1 if unsplit
        mOPartial: cute.Tensor,   # fp32 [R, D]: split-KV partial outputs (normalised by own l)
        mLsePartial: cute.Tensor,  # fp32 [R]: split-KV partial log2-sum-exp (scaled units)
        group_size: cutlass.Int32,
        softmax_scale_log2: cutlass.Float32,
        num_ctas: cutlass.Int32,
        stream,
        mKey,
        mValue,
    ):
        """Host body shared by ``__call__`` and ``fused`` (inlined into either at trace time)."""
        dt = self.dtype
        D = self.head_dim
        P = self.page
        Gp = self.group_pad
        TPT = TILE_M // Gp  # tokens of one 64-row packed Q box

        # Q viewed as (head, token, d): a (Gp, TPT, D) box starting at head h*G is the packed tile.
        q_view = cute.make_tensor(
            mQ.iterator,
            cute.make_layout((mQ.shape[1], mQ.shape[0], D), stride=(mQ.stride[1], mQ.stride[0], 1)),
        )
        # K viewed as (row, d, head, page): K-major B operand of S = Q K^T.
        k_view = cute.make_tensor(
            mK.iterator,
            cute.make_layout((P, D, mK.shape[1], mK.shape[0]),
                             stride=(mK.stride[2], 1, mK.stride[1], mK.stride[0])),
        )
        # V viewed as (d, row, head, page): MN-major B operand of O = P V.
        v_view = cute.make_tensor(
            mV.iterator,
            cute.make_layout((D, P, mV.shape[1], mV.shape[0]),
                             stride=(1, mV.stride[2], mV.stride[1], mV.stride[0])),
        )

        N = self.kv_tile  # keys of one K/V stage (= P unless kv_pair)
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (TILE_M, N))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (TILE_M, D), warpgroup.OperandSource.RMEM)

        q_smem_staged = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, (TILE_M, P, D), dt, self.q_bufs)
        k_smem_staged = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, (TILE_M, N, D), dt, self.kv_stages)
        v_smem_staged = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.COL_MAJOR, (TILE_M, D, N), dt, self.kv_stages)
        # the smem of one page's TMA box: the whole stage, or with kv_pair half a stage;
        # k/v_pair_smem view a stage as (page rows, d, half) / (d, page rows, half)
        k_box_smem = cute.slice_(k_smem_staged, (None, None, 0))
        v_box_smem = cute.slice_(v_smem_staged, (None, None, 0))
        pair_args = {}
        if cutlass.const_expr(self.kv_pair):
            k_pair_smem = cute.composition(
                k_box_smem, cute.make_layout((P, D, 2), stride=(1, N, P)))
            v_pair_smem = cute.composition(
                v_box_smem, cute.make_layout((D, P, 2), stride=(1, D, D * P)))
            k_box_smem = cute.slice_(k_pair_smem, (None, None, 0))
            v_box_smem = cute.slice_(v_pair_smem, (None, None, 0))
            pair_args = dict(k_pair_smem=k_pair_smem, v_pair_smem=v_pair_smem)

        # The packed-GQA Q box: smem rows r = t * Gp + g, viewed as (Gp, TPT, D).
        q_smem_one = cute.slice_(q_smem_staged, (None, None, 0))
        q_smem_box = cute.composition(
            q_smem_one, cute.make_layout((Gp, TPT, D), stride=(1, Gp, TILE_M)))
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q_view, q_smem_box, (Gp, TPT, D))
        unpacked_args = {}
        if cutlass.const_expr(self.unpacked):
            # unpacked Q box: one head x TILE_M tokens, smem row r = token r
            q_smem_box_u = cute.composition(
                q_smem_one, cute.make_layout((1, TILE_M, D), stride=(1, 1, TILE_M)))
            tma_qu, tma_tensor_qu = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), q_view, q_smem_box_u, (1, TILE_M, D))
            unpacked_args = dict(tma_qu=tma_qu, mQu_tma=tma_tensor_qu, q_smem_box_u=q_smem_box_u)
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), k_view, k_box_smem, (P, D))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), v_view, v_box_smem, (D, P))

        fresh_args = ()
        if cutlass.const_expr(self.fresh_kv):
            # new K as (token, d, head): a (P, D) box at token row tok of head h is fresh
            # tile rows tok .. tok+P-1 (rows past T are zero-filled by TMA)
            kf_view = cute.make_tensor(
                mKey.iterator,
                cute.make_layout((mKey.shape[0], D, mKey.shape[1]),
                                 stride=(mKey.stride[0], 1, mKey.stride[1])),
            )
            # new V as (d, token, head), MN-major like the V pages
            vf_view = cute.make_tensor(
                mValue.iterator,
                cute.make_layout((D, mValue.shape[0], mValue.shape[1]),
                                 stride=(1, mValue.stride[0], mValue.stride[1])),
            )
            tma_kf, tma_tensor_kf = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), kf_view, k_box_smem, (P, D))
            tma_vf, tma_tensor_vf = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), vf_view, v_box_smem, (D, P))
            # writeback: the same smem tiles stored into cache pages (row offset per store;
            # rows outside the page [0, P) are clipped by the TMA bounds of the row mode)
            tma_ks, tma_tensor_ks = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), k_view, k_box_smem, (P, D))
            tma_vs, tma_tensor_vs = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), v_view, v_box_smem, (D, P))
            fresh_args = (tma_kf, tma_tensor_kf, tma_vf, tma_tensor_vf,
                          tma_ks, tma_tensor_ks, tma_vs, tma_tensor_vs, k_view, v_view)

        self.q_bytes = cute.size_in_bytes(dt, q_smem_one)
        self.kv_bytes = cute.size_in_bytes(dt, cute.slice_(k_smem_staged, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            q_mbar: cute.struct.MemRange[cutlass.Int64, self.q_stages * 2]
            k_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            v_mbar: cute.struct.MemRange[cutlass.Int64, self.kv_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(q_smem_staged)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_smem_staged)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(v_smem_staged)], 1024]

        self.shared_storage = SharedStorage

        self.kernel(
            qk_mma, pv_mma, tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v,
            mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets, mPartialOffsets, mOPartial,
            mLsePartial, group_size, softmax_scale_log2,
            q_smem_staged, q_smem_box, k_smem_staged, v_smem_staged, *fresh_args,
            **unpacked_args, **pair_args,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=100,  # percent: all of the unified L1/smem as smem
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        mQ_tma: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK_tma: cute.Tensor,
        tma_v: cute.CopyAtom,
        mV_tma: cute.Tensor,
        mO: cute.Tensor,
        mQSL: cute.Tensor,
        mSeqLens: cute.Tensor,
        mBlockTable: cute.Tensor,
        mWork: cute.Tensor,
        mOffsets: cute.Tensor,
        mPartialOffsets: cute.Tensor,
        mOPartial: cute.Tensor,
        mLsePartial: cute.Tensor,
        group_size: cutlass.Int32,
        scale_log2: cutlass.Float32,
        q_smem_staged: cute.ComposedLayout,
        q_smem_box: cute.ComposedLayout,
        k_smem_staged: cute.ComposedLayout,
        v_smem_staged: cute.ComposedLayout,
        tma_kf: cute.CopyAtom = None,     # fresh_kv only: new K / V loads, cache stores
        mKf_tma: cute.Tensor = None,
        tma_vf: cute.CopyAtom = None,
        mVf_tma: cute.Tensor = None,
        tma_ks: cute.CopyAtom = None,
        mKs_tma: cute.Tensor = None,
        tma_vs: cute.CopyAtom = None,
        mVs_tma: cute.Tensor = None,
        mKc: cute.Tensor = None,          # fresh_kv only: the caches as (row, d, head, page)
        mVc: cute.Tensor = None,          # and (d, row, head, page), for the straddle copy
        tma_qu: cute.CopyAtom = None,     # unpacked_prefill only: 1 head x 64 tokens Q box
        mQu_tma: cute.Tensor = None,
        q_smem_box_u: cute.ComposedLayout = None,
        k_pair_smem: cute.ComposedLayout = None,  # kv_pair only: a stage as two page boxes
        v_pair_smem: cute.ComposedLayout = None,
    ):
        D = self.head_dim
        P = self.page
        Gp = self.group_pad
        TPT = TILE_M // Gp  # tokens of one 64-row packed Q box

        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # a Q stage is one 64-row box per consumer warpgroup; every stage is released by
        # the 4 warps of each consumer warpgroup (4 * consumers arrivals)
        q_pipe = self._tma_pipeline(storage.q_mbar.data_ptr(), self.q_stages,
                                    self.q_bytes * self.consumers, 4 * self.consumers)
        k_pipe = self._tma_pipeline(storage.k_mbar.data_ptr(), self.kv_stages, self.kv_bytes,
                                    4 * self.consumers)
        v_pipe = self._tma_pipeline(storage.v_mbar.data_ptr(), self.kv_stages, self.kv_bytes,
                                    4 * self.consumers)
        q_prod, q_cons = q_pipe.make_participants()
        k_prod, k_cons = k_pipe.make_participants()
        v_prod, v_cons = v_pipe.make_participants()

        sQ = storage.sQ.get_tensor(q_smem_staged.outer, swizzle=q_smem_staged.inner)
        sK = storage.sK.get_tensor(k_smem_staged.outer, swizzle=k_smem_staged.inner)
        sV = storage.sV.get_tensor(v_smem_staged.outer, swizzle=v_smem_staged.inner)
        # (Gp, TPT, D, stages) view of the Q buffer for the TMA box
        sQ_box = cute.make_tensor(
            cute.recast_ptr(sQ.iterator, q_smem_box.inner),
            cute.append(q_smem_box.outer, cute.make_layout(self.q_bufs,
                                                           stride=cute.cosize(q_smem_box.outer))),
        )

        sQ_box_u = None
        if cutlass.const_expr(self.unpacked):
            # (1, TILE_M, D, stages) view of the Q buffer for the unpacked TMA box
            sQ_box_u = cute.make_tensor(
                cute.recast_ptr(sQ.iterator, q_smem_box_u.inner),
                cute.append(q_smem_box_u.outer,
                            cute.make_layout(self.q_bufs,
                                             stride=cute.cosize(q_smem_box_u.outer))),
            )

        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        item_begin = mOffsets[bidx]
        item_end = mOffsets[bidx + 1]
        # programmatic dependent launch: a kernel queued after this one with PDL (the
        # split-KV combine, ``CombineSm90(pdl=True)``) may be scheduled now and wait at its
        # own griddepcontrol.wait for this grid to finish and flush, so its launch latency
        # hides under this grid's tail.  No effect on a dependent launched without PDL.
        cute.arch.griddepcontrol_launch_dependents()

        if wg_idx == 0:
            # ------------------------------------------------------------ producer
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_q)
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                if cutlass.const_expr(self.unpacked):
                    cpasync.prefetch_descriptor(tma_qu)
                if cutlass.const_expr(self.fresh_kv):
                    cpasync.prefetch_descriptor(tma_kf)
                    cpasync.prefetch_descriptor(tma_vf)
                    cpasync.prefetch_descriptor(tma_ks)
                    cpasync.prefetch_descriptor(tma_vs)
                gK = cute.flat_divide(mK_tma, (P, D))        # (P, D, 1, 1, Hkv, NB)
                gV = cute.flat_divide(mV_tma, (D, P))        # (D, P, 1, 1, Hkv, NB)
                sK_tma = sK
                sV_tma = sV
                if cutlass.const_expr(self.kv_pair):
                    # (rows, d, half, stage) / (d, rows, half, stage): page boxes of a stage
                    sK_tma = cute.make_tensor(
                        cute.recast_ptr(sK.iterator, k_pair_smem.inner),
                        cute.append(k_pair_smem.outer, cute.make_layout(
                            self.kv_stages, stride=cute.cosize(k_pair_smem.outer))))
                    sV_tma = cute.make_tensor(
                        cute.recast_ptr(sV.iterator, v_pair_smem.inner),
                        cute.append(v_pair_smem.outer, cute.make_layout(
                            self.kv_stages, stride=cute.cosize(v_pair_smem.outer))))
                tKsK, tKgK = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1), cute.group_modes(sK_tma, 0, 2),
                    cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(
                    tma_v, 0, cute.make_layout(1), cute.group_modes(sV_tma, 0, 2),
                    cute.group_modes(gV, 0, 2))
                for it in cutlass.range(item_begin, item_end, 1, unroll=1):
                    b = mWork[it, W_REQ]
                    h = mWork[it, W_HEAD]
                    q_start = mWork[it, W_QSTART]
                    p0 = mWork[it, W_P0]
                    p1 = mWork[it, W_P1]
                    tok0 = mQSL[b] + q_start
                    qh = -1
                    if cutlass.const_expr(self.consumers >= 2):
                        # 128-row tile: two 64-row Q boxes (one per consumer warpgroup) into
                        # buffers 2 * stage + half, completing on the stage's one barrier
                        q_handle = q_prod.acquire_and_advance()
                        if cutlass.const_expr(self.unpacked):
                            qh = mWork[it, W_QHEAD]
                        self._load_q_halves(tma_q, mQ_tma, sQ_box, tma_qu, mQu_tma, sQ_box_u,
                                            q_handle, h * group_size, tok0, qh)
                    elif cutlass.const_expr(not self.unpacked):
                        # packed Q tile: heads h*G .. h*G+Gp-1, tokens tok0 .. tok0+TPT-1
                        gQ = cute.local_tile(
                            cute.domain_offset((h * group_size, tok0, 0), mQ_tma),
                            (Gp, TPT, D), (0, 0, 0))
                        tQsQ, tQgQ = cpasync.tma_partition(
                            tma_q, 0, cute.make_layout(1), cute.group_modes(sQ_box, 0, 3),
                            cute.group_modes(gQ, 0, 3))
                        q_handle = q_prod.acquire_and_advance()
                        cute.copy(tma_q, tQgQ, tQsQ[(None, q_handle.index)],
                                  tma_bar_ptr=q_handle.barrier)
                    else:
                        qh = mWork[it, W_QHEAD]
                        q_handle = q_prod.acquire_and_advance()
                        if qh < 0:
                            gQp = cute.local_tile(
                                cute.domain_offset((h * group_size, tok0, 0), mQ_tma),
                                (Gp, TPT, D), (0, 0, 0))
                            tQsQp, tQgQp = cpasync.tma_partition(
                                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ_box, 0, 3),
                                cute.group_modes(gQp, 0, 3))
                            cute.copy(tma_q, tQgQp, tQsQp[(None, q_handle.index)],
                                      tma_bar_ptr=q_handle.barrier)
                        else:
                            # unpacked Q tile: head h*G + qh, tokens tok0 .. tok0+63
                            gQu = cute.local_tile(
                                cute.domain_offset((h * group_size + qh, tok0, 0), mQu_tma),
                                (1, TILE_M, D), (0, 0, 0))
                            tQsQu, tQgQu = cpasync.tma_partition(
                                tma_qu, 0, cute.make_layout(1),
                                cute.group_modes(sQ_box_u, 0, 3), cute.group_modes(gQu, 0, 3))
                            cute.copy(tma_qu, tQgQu, tQsQu[(None, q_handle.index)],
                                      tma_bar_ptr=q_handle.barrier)
                    if cutlass.const_expr(not self.fresh_kv and self.kv_stages == 1):
                        # one K/V stage: issue K_{p+1} before V_p.  The consumer frees K_p
                        # after S_p, early in its iteration p, but frees V_{p-1} only at the
                        # end of it (PV_{p-1} runs there); in the order K_p, V_p, K_{p+1}
                        # the next K would wait behind that, and iteration p+1 would start
                        # on a load just issued.  Each pipeline's acquire order is unchanged.
                        k0 = k_prod.acquire_and_advance()
                        cute.copy(tma_k, tKgK[(None, 0, 0, h, mBlockTable[b, p0])],
                                  tKsK[(None, k0.index)], tma_bar_ptr=k0.barrier)
                        for p in cutlass.range(p0, p1, 1, unroll=1):
                            if p + 1 < p1:
                                kn = k_prod.acquire_and_advance()
                                cute.copy(tma_k, tKgK[(None, 0, 0, h, mBlockTable[b, p + 1])],
                                          tKsK[(None, kn.index)], tma_bar_ptr=kn.barrier)
                            vp = v_prod.acquire_and_advance()
                            cute.copy(tma_v, tVgV[(None, 0, 0, h, mBlockTable[b, p])],
                                      tVsV[(None, vp.index)], tma_bar_ptr=vp.barrier)
                    elif cutlass.const_expr(self.kv_pair and not self.fresh_kv):
                        # pages p, p + 1 into the two halves of one stage (one barrier,
                        # 2 x 2 boxes); an odd last page goes into both halves, and the
                        # consumer masks the copy (its keys sit past p1 * P)
                        for p in cutlass.range(p0, p1, 2, unroll=1):
                            page_a = mBlockTable[b, p]
                            page_b = page_a
                            if p + 1 < p1:
                                page_b = mBlockTable[b, p + 1]
                            k_handle = k_prod.acquire_and_advance()
                            cute.copy(tma_k, tKgK[(None, 0, 0, h, page_a)],
                                      tKsK[(None, 0, k_handle.index)],
                                      tma_bar_ptr=k_handle.barrier)
                            cute.copy(tma_k, tKgK[(None, 0, 0, h, page_b)],
                                      tKsK[(None, 1, k_handle.index)],
                                      tma_bar_ptr=k_handle.barrier)
                            v_handle = v_prod.acquire_and_advance()
                            cute.copy(tma_v, tVgV[(None, 0, 0, h, page_a)],
                                      tVsV[(None, 0, v_handle.index)],
                                      tma_bar_ptr=v_handle.barrier)
                            cute.copy(tma_v, tVgV[(None, 0, 0, h, page_b)],
                                      tVsV[(None, 1, v_handle.index)],
                                      tma_bar_ptr=v_handle.barrier)
                    elif cutlass.const_expr(not self.fresh_kv):
                        for p in cutlass.range(p0, p1, 1, unroll=1):
                            page = mBlockTable[b, p]
                            k_handle = k_prod.acquire_and_advance()
                            cute.copy(tma_k, tKgK[(None, 0, 0, h, page)],
                                      tKsK[(None, k_handle.index)], tma_bar_ptr=k_handle.barrier)
                            v_handle = v_prod.acquire_and_advance()
                            cute.copy(tma_v, tVgV[(None, 0, 0, h, page)],
                                      tVsV[(None, v_handle.index)], tma_bar_ptr=v_handle.barrier)
                    elif cutlass.const_expr(self.kv_pair):
                        # fused writeback on page pairs: KV units u, u + 1 into the halves
                        # of one stage (an odd last unit into both; the copy is masked and
                        # never stored), each loaded and, if owned, stored as below; one
                        # bulk-group commit per stage
                        S = self.kv_stages
                        q_cnt = mWork[it, W_QLEN]
                        tok_base = mQSL[b]
                        q_len = mQSL[b + 1] - tok_base
                        seq_len = mSeqLens[b]
                        ctx = seq_len - q_len
                        n_old = (ctx + P - 1) // P
                        for u in cutlass.range(p0, p1, 2, unroll=1):
                            cute.arch.cp_async_bulk_wait_group(S - 1, read=True)
                            u_b = u + 1
                            if u_b >= p1:
                                u_b = u
                            k_handle = k_prod.acquire_and_advance()
                            for half in cutlass.range_constexpr(2):
                                self._load_unit_half(
                                    tma_k, tKgK, tKsK, tma_kf, mKf_tma, sK_tma, (P, D), 0,
                                    u if half == 0 else u_b, n_old, tok_base, b, h, half,
                                    k_handle, mBlockTable)
                            v_handle = v_prod.acquire_and_advance()
                            for half in cutlass.range_constexpr(2):
                                self._load_unit_half(
                                    tma_v, tVgV, tVsV, tma_vf, mVf_tma, sV_tma, (D, P), 1,
                                    u if half == 0 else u_b, n_old, tok_base, b, h, half,
                                    v_handle, mBlockTable)
                            for half in cutlass.range_constexpr(2):
                                unit = u if half == 0 else u_b
                                if unit >= n_old:
                                    kt = unit - n_old
                                    t_own = cutlass.min(kt * P + P - 1, q_len - 1)
                                    if cutlass.const_expr(self.unpacked):
                                        if qh > 0:
                                            t_own = cutlass.Int32(-1)
                                    if cutlass.const_expr(half == 1):
                                        if u + 1 >= p1:
                                            t_own = cutlass.Int32(-1)  # the copy: no store
                                    if t_own >= q_start:
                                        if t_own < q_start + q_cnt:
                                            self._store_fresh_half(
                                                tma_ks, mKs_tma, tma_vs, mVs_tma, sK, sV,
                                                sK_tma, sV_tma, mKc, mVc, k_handle, v_handle,
                                                half, ctx + kt * P, seq_len, h, b,
                                                mBlockTable, tidx % 32)
                            cute.arch.cp_async_bulk_commit_group()
                    else:
                        # fused writeback (see the class docstring): old pages from the
                        # cache, fresh tile k (unit n_old + k) = new K/V rows qsl[b] + k*P ..;
                        # an owned fresh tile (planner.fresh_tile_owned) is TMA-stored from
                        # its stage into the cache.  Bulk groups: one commit per unit (empty
                        # when nothing is stored); a stage is refilled only after the store
                        # issued from it kv_stages units earlier has finished reading smem.
                        S = self.kv_stages
                        q_cnt = mWork[it, W_QLEN]
                        tok_base = mQSL[b]
                        q_len = mQSL[b + 1] - tok_base
                        seq_len = mSeqLens[b]
                        ctx = seq_len - q_len
                        n_old = (ctx + P - 1) // P
                        for u in cutlass.range(p0, p1, 1, unroll=1):
                            cute.arch.cp_async_bulk_wait_group(S - 1, read=True)
                            if u < n_old:
                                page = mBlockTable[b, u]
                                k_handle = k_prod.acquire_and_advance()
                                cute.copy(tma_k, tKgK[(None, 0, 0, h, page)],
                                          tKsK[(None, k_handle.index)],
                                          tma_bar_ptr=k_handle.barrier)
                                v_handle = v_prod.acquire_and_advance()
                                cute.copy(tma_v, tVgV[(None, 0, 0, h, page)],
                                          tVsV[(None, v_handle.index)],
                                          tma_bar_ptr=v_handle.barrier)
                            else:
                                kt = u - n_old
                                tok = tok_base + kt * P
                                gKf = cute.flat_divide(
                                    cute.domain_offset((tok, 0, 0), mKf_tma), (P, D))
                                tKsKf, tKgKf = cpasync.tma_partition(
                                    tma_kf, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                    cute.group_modes(gKf, 0, 2))
                                gVf = cute.flat_divide(
                                    cute.domain_offset((0, tok, 0), mVf_tma), (D, P))
                                tVsVf, tVgVf = cpasync.tma_partition(
                                    tma_vf, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                    cute.group_modes(gVf, 0, 2))
                                k_handle = k_prod.acquire_and_advance()
                                cute.copy(tma_kf, tKgKf[(None, 0, 0, h)],
                                          tKsKf[(None, k_handle.index)],
                                          tma_bar_ptr=k_handle.barrier)
                                v_handle = v_prod.acquire_and_advance()
                                cute.copy(tma_vf, tVgVf[(None, 0, 0, h)],
                                          tVsVf[(None, v_handle.index)],
                                          tma_bar_ptr=v_handle.barrier)
                                # owner: the q tile holding new token min(k*P+P-1, q_len-1)
                                t_own = cutlass.min(kt * P + P - 1, q_len - 1)
                                if cutlass.const_expr(self.unpacked):
                                    # G unpacked items hold the owner token: q head 0 stores
                                    if qh > 0:
                                        t_own = cutlass.Int32(-1)
                                if t_own >= q_start:
                                    if t_own < q_start + q_cnt:
                                        pos = ctx + kt * P
                                        pg = pos // P
                                        off = pos - pg * P
                                        # valid rows (positions < seq_len) reach into page
                                        # pg + 1; never touch a page past the request's last
                                        two = cutlass.min(pos + P, seq_len) > (pg + 1) * P
                                        page1 = mBlockTable[b, pg]
                                        page2 = page1
                                        if two:
                                            page2 = mBlockTable[b, pg + 1]
                                        # wait for the tile on the full-barrier phase the
                                        # consumer waits on (waiting does not consume it),
                                        # then store it from smem
                                        cute.arch.mbarrier_wait(k_handle.barrier,
                                                                (k_handle.count // S) % 2)
                                        # valid rows reaching into page pg + 1
                                        n2 = cutlass.min(pos + P, seq_len) - (pg + 1) * P
                                        lane = tidx % 32
                                        self._store_tile(tma_ks, mKs_tma, sK, k_handle.index,
                                                         (P, D), 0, off, h, page1)
                                        if two:
                                            self._straddle(mKc, sK, k_handle.index, P - off,
                                                           n2, h, page2, lane, False)
                                        cute.arch.mbarrier_wait(v_handle.barrier,
                                                                (v_handle.count // S) % 2)
                                        self._store_tile(tma_vs, mVs_tma, sV, v_handle.index,
                                                         (D, P), 1, off, h, page1)
                                        if two:
                                            self._straddle(mVc, sV, v_handle.index, P - off,
                                                           n2, h, page2, lane, True)
                            cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(self.fresh_kv):
                    # every writeback store has finished before the CTA (and its smem) exits
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
        else:
            # ------------------------------------------------------------ consumer
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            ctid = tidx - 128
            q_half = 0
            if cutlass.const_expr(self.consumers >= 2):
                # consumer warpgroup w = 1, 2 computes rows 64*(w-1) .. +63 of the 128-row
                # tile from Q buffer 2 * stage + (w - 1)
                ctid = tidx - 128 * wg_idx
                q_half = wg_idx - 1
            # accumulate-always: S is zeroed in registers before each QK^T, so the tiled MMAs
            # are never mutated inside the dynamic loops
            qk_mma.set(warpgroup.Field.ACCUMULATE, True)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            qk_thr = qk_mma.get_slice(ctid)
            pv_thr = pv_mma.get_slice(ctid)
            tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))
            tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sK))
            tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))
            NK = self.kv_tile
            acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_M, NK)))
            acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_M, D)))
            tScS = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, NK)))
            tOcO = pv_thr.partition_C(cute.make_identity_tensor((TILE_M, D)))
            rP = cute.make_rmem_tensor(
                pv_thr.partition_shape_A((TILE_M, NK)), self.dtype)
            rP_as_s = cute.make_tensor(rP.iterator, acc_s.layout)
            row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
            row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
            corr = cute.make_rmem_tensor((2,), cutlass.Float32)
            if cutlass.const_expr(self.pingpong):
                # consumer warpgroup 1 holds the first turn
                if q_half == 0:
                    cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER,
                                             number_of_threads=256)

            for it in cutlass.range(item_begin, item_end, 1, unroll=1):
                b = mWork[it, W_REQ]
                h = mWork[it, W_HEAD]
                q_start = mWork[it, W_QSTART]
                q_cnt = mWork[it, W_QLEN]
                p0 = mWork[it, W_P0]
                p1 = mWork[it, W_P1]
                seq_len = mSeqLens[b]
                q_len = mQSL[b + 1] - mQSL[b]
                # absolute position of the tile's first token
                pos0 = seq_len - q_len + q_start
                # row -> (token, q head): packed rows r = t * Gp + g; unpacked rows r = t
                shift = None
                gmask = None
                head_base = None
                if cutlass.const_expr(self.unpacked):
                    qh = mWork[it, W_QHEAD]
                    head_base = h * group_size
                    shift = cutlass.Int32(self.log2_gp)
                    gmask = cutlass.Int32(Gp - 1)
                    if qh >= 0:
                        shift = cutlass.Int32(0)
                        gmask = cutlass.Int32(0)
                        head_base = head_base + qh
                poff_rows = 0
                if cutlass.const_expr(self.consumers >= 2):
                    # this warpgroup's half as a 64-row tile: its first token is tok_off
                    # tokens into the item (row 64*(w-1) -> token (64*(w-1)) >> shift), it
                    # holds q_cnt - tok_off of the item's tokens (<= 0: none, nothing is
                    # stored) and its split-KV partial rows start 64*(w-1) rows further
                    poff_rows = q_half * TILE_M
                    tok_off = q_half * TPT
                    if cutlass.const_expr(self.unpacked):
                        tok_off = poff_rows >> shift
                    pos0 = pos0 + tok_off
                    q_start = q_start + tok_off
                    q_cnt = q_cnt - tok_off
                # skip_idle: whether this warpgroup's rows hold a token (uniform across the
                # warpgroup, as the .aligned wgmma needs)
                active = None
                if cutlass.const_expr(self.skip_idle):
                    active = q_cnt > 0
                ctx = 0
                n_old = 0
                u_part = 0
                u_diag = 0
                if cutlass.const_expr(self.fresh_kv):
                    # units < n_old are cache pages, the rest fresh tiles
                    ctx = seq_len - q_len
                    n_old = (ctx + P - 1) // P
                    # the units _mask_unit masks, decided once an item: u == u_part or
                    # u >= u_diag (planner.fresh_mask_units states the rule)
                    u_part = cutlass.Int32(-1)
                    if n_old * P != ctx:
                        u_part = n_old - 1
                    u_diag = n_old + (cutlass.min(pos0, seq_len - 1) - ctx + 1) // P

                row_max[0] = -cutlass.Float32.inf
                row_max[1] = -cutlass.Float32.inf
                row_sum[0] = cutlass.Float32(0.0)
                row_sum[1] = cutlass.Float32(0.0)
                acc_o.fill(0.0)

                q_handle = q_cons.wait_and_advance()
                q_buf = q_handle.index
                if cutlass.const_expr(self.consumers >= 2):
                    q_buf = q_handle.index * self.consumers + q_half
                # first page: S = Q K^T, softmax -> P
                k_handle = k_cons.wait_and_advance()
                self._turn_wait(q_half)
                self._maybe_qk(active, qk_mma, acc_s, tSrQ, tSrK, q_buf, k_handle.index)
                self._turn_pass(q_half)
                cute.nvgpu.warpgroup.wait_group(0)
                k_handle.release()
                # kv_pair: keys past the item's last page (the copy in an odd last stage)
                kv_lim = None
                if cutlass.const_expr(self.kv_pair):
                    kv_lim = cutlass.min(seq_len, p1 * P) - 1
                if cutlass.const_expr(self.fresh_kv and self.kv_pair):
                    self._mask_unit_pair(acc_s, tScS, p0, p1, n_old, ctx, pos0, seq_len,
                                         shift)
                elif cutlass.const_expr(self.fresh_kv):
                    self._mask_unit(acc_s, tScS, p0, n_old, ctx, pos0, seq_len, shift,
                                        u_part, u_diag)
                elif cutlass.const_expr(self.kv_pair):
                    self._mask_limited(acc_s, tScS, p0 * P, pos0, kv_lim, shift)
                else:
                    self._mask(acc_s, tScS, p0 * P, pos0, seq_len, shift)
                self._online_softmax(acc_s, row_max, row_sum, corr, scale_log2)
                rP_as_s.store(acc_s.load().to(self.dtype))
                # steady state: S_p = Q K_p^T runs on the tensor cores while the softmax of the
                # previous page is consumed by O += P V_{p-1}; O is rescaled once that PV is done.
                for p in cutlass.range(p0 + self.pages_per_tile, p1, self.pages_per_tile,
                                       unroll=1):
                    k_handle = k_cons.wait_and_advance()
                    self._turn_wait(q_half)
                    self._maybe_qk(active, qk_mma, acc_s, tSrQ, tSrK, q_buf, k_handle.index)
                    v_handle = v_cons.wait_and_advance()
                    self._maybe_pv(active, pv_mma, acc_o, rP, tOrV, v_handle.index)
                    self._turn_pass(q_half)
                    cute.nvgpu.warpgroup.wait_group(1)
                    k_handle.release()
                    if cutlass.const_expr(self.fresh_kv and self.kv_pair):
                        self._mask_unit_pair(acc_s, tScS, p, p1, n_old, ctx, pos0, seq_len,
                                             shift)
                    elif cutlass.const_expr(self.fresh_kv):
                        self._mask_unit(acc_s, tScS, p, n_old, ctx, pos0, seq_len, shift,
                                        u_part, u_diag)
                    elif cutlass.const_expr(self.kv_pair):
                        self._mask_limited(acc_s, tScS, p * P, pos0, kv_lim, shift)
                    else:
                        self._mask(acc_s, tScS, p * P, pos0, seq_len, shift)
                    self._online_softmax(acc_s, row_max, row_sum, corr, scale_log2)
                    self._wait_pv(row_sum, group_size)
                    v_handle.release()
                    if cutlass.const_expr(self.lazy_rescale):
                        if corr[0] != 1.0 or corr[1] != 1.0:
                            self._rescale(acc_o, corr)
                    else:
                        self._rescale(acc_o, corr)
                    rP_as_s.store(acc_s.load().to(self.dtype))
                v_handle = v_cons.wait_and_advance()
                self._maybe_pv(active, pv_mma, acc_o, rP, tOrV, v_handle.index)
                cute.nvgpu.warpgroup.wait_group(0)
                v_handle.release()
                q_handle.release()

                # ---------------------------------------------------------- epilogue
                for slot in cutlass.range_constexpr(2):
                    row_sum[slot] = cute.arch.warp_reduction_sum(row_sum[slot], threads_in_group=4)
                row0 = tOcO[0][0]
                poff = mPartialOffsets[it]
                if poff < 0:
                    if cutlass.const_expr(self.unpacked):
                        self._store_out(acc_o, tOcO, row_sum, mO, row0, q_cnt, group_size,
                                        mQSL[b] + q_start, head_base, shift, gmask)
                    else:
                        self._store_out(acc_o, tOcO, row_sum, mO, row0, q_cnt, group_size,
                                        mQSL[b] + q_start, h * group_size)
                else:
                    poff_w = poff
                    if cutlass.const_expr(self.unpacked):
                        # packed items: poff_w + row as in the default kernel; unpacked
                        # items: chunked rows (planner.partial_row) from poff = base + q
                        # head, the item's split index, split count and token count; this
                        # warpgroup's first token is tok_u tokens into the item
                        tok_u = 0
                        if cutlass.const_expr(self.consumers >= 2):
                            poff_w = poff + poff_rows
                            tok_u = tok_off
                        self._store_partial(acc_o, tOcO, row_max, row_sum, mOPartial,
                                            mLsePartial, row0, q_cnt, group_size, poff_w,
                                            scale_log2, shift, gmask, qh, poff, tok_u,
                                            mWork[it, W_SPLIT], mWork[it, W_NSPLIT],
                                            mWork[it, W_QLEN])
                    else:
                        if cutlass.const_expr(self.consumers >= 2):
                            poff_w = poff + poff_rows
                        self._store_partial(acc_o, tOcO, row_max, row_sum, mOPartial,
                                            mLsePartial, row0, q_cnt, group_size, poff_w,
                                            scale_log2)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _tma_pipeline(barriers, stages: int, tx_bytes: int, consumer_arrivals: int = 4):
        """mbarrier pipeline: one TMA-issuing producer thread; the consumer side is released
        by lane 0 of every consumer warp (PipelineTmaAsync signals once per warp), so the
        empty barriers count 4 arrivals per consumer warpgroup."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=tx_bytes,
            defer_sync=True,
        )

    @cute.jit
    def _load_q_halves(self, tma_q, mQ_tma, sQ_box, tma_qu, mQu_tma, sQ_box_u, q_handle,
                       head0, tok0, qh):
        """consumers=2: the Q stage of a 128-row tile as two 64-row boxes, box ``half`` into
        buffer ``2 * stage + half`` (the Q of consumer warpgroup ``half + 1``).  Packed:
        (Gp heads, 64 // Gp tokens) at token ``tok0 + half * 64 // Gp``; unpacked item
        (``qh >= 0``): (q head ``head0 + qh``, 64 tokens) at token ``tok0 + half * 64``."""
        Gp = self.group_pad
        D = self.head_dim
        TPT = TILE_M // Gp
        for half in cutlass.range_constexpr(self.consumers):
            buf = q_handle.index * self.consumers + half
            if cutlass.const_expr(self.unpacked):
                if qh < 0:
                    self._load_q_box(tma_q, mQ_tma, sQ_box, (Gp, TPT, D), head0,
                                     tok0 + half * TPT, buf, q_handle.barrier)
                else:
                    self._load_q_box(tma_qu, mQu_tma, sQ_box_u, (1, TILE_M, D), head0 + qh,
                                     tok0 + half * TILE_M, buf, q_handle.barrier)
            else:
                self._load_q_box(tma_q, mQ_tma, sQ_box, (Gp, TPT, D), head0,
                                 tok0 + half * TPT, buf, q_handle.barrier)

    @cute.jit
    def _load_q_box(self, tma, mQ_tma, sQ_box, box, head, tok, buf, bar):
        """One Q TMA box (heads, tokens, D) at (head, tok) into Q buffer ``buf``."""
        gQ = cute.local_tile(cute.domain_offset((head, tok, 0), mQ_tma), box, (0, 0, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(sQ_box, 0, 3),
            cute.group_modes(gQ, 0, 3))
        cute.copy(tma, tQgQ, tQsQ[(None, buf)], tma_bar_ptr=bar)

    @cute.jit
    def _issue_qk(self, qk_mma, acc_s, tSrQ, tSrK, q_stage, k_stage):
        acc_s.fill(0.0)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(qk_mma, acc_s, tSrQ[(None, None, kb, q_stage)],
                      tSrK[(None, None, kb, k_stage)], acc_s)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, pv_mma, acc_o, rP, tOrV, v_stage):
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
            cute.gemm(pv_mma, acc_o, rP[(None, None, kb)], tOrV[(None, None, kb, v_stage)], acc_o)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _maybe_qk(self, active, qk_mma, acc_s, tSrQ, tSrK, q_stage, k_stage):
        """``_issue_qk``; with ``skip_idle`` only when ``active`` (an idle warpgroup's S is
        left stale: none of its rows is stored)."""
        if cutlass.const_expr(self.skip_idle):
            if active:
                self._issue_qk(qk_mma, acc_s, tSrQ, tSrK, q_stage, k_stage)
        else:
            self._issue_qk(qk_mma, acc_s, tSrQ, tSrK, q_stage, k_stage)

    @cute.jit
    def _maybe_pv(self, active, pv_mma, acc_o, rP, tOrV, v_stage):
        """``_issue_pv``; with ``skip_idle`` only when ``active``."""
        if cutlass.const_expr(self.skip_idle):
            if active:
                self._issue_pv(pv_mma, acc_o, rP, tOrV, v_stage)
        else:
            self._issue_pv(pv_mma, acc_o, rP, tOrV, v_stage)

    @cute.jit
    def _wait_pv(self, row_sum, group_size):
        """``wgmma.wait_group 0`` after the softmax: plain, or with ``pin_pv_wait`` in both
        arms of a branch on the softmax's result, which ptxas does not hoist it across.
        ``wgmma.wait_group`` is ``.aligned``: every thread of the warpgroup must take the
        same arm, so the condition is ``row_sum >= 0 or group_size > 0``.  The launch
        refuses ``group_size < 1``, so it is true in every thread, NaN rows included; the
        compiler cannot know that, so the branch still waits for the row sum."""
        if cutlass.const_expr(self.pin_pv_wait):
            if (row_sum[0] >= cutlass.Float32(0.0)) | (group_size > 0):
                cute.nvgpu.warpgroup.wait_group(0)
            else:
                cute.nvgpu.warpgroup.wait_group(0)
        else:
            cute.nvgpu.warpgroup.wait_group(0)

    @cute.jit
    def _turn_wait(self, q_half):
        """pingpong: wait until the other consumer warpgroup has issued its MMAs (barrier
        ``PINGPONG_BARRIER + q_half`` completes with its arrive); no code otherwise."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=PINGPONG_BARRIER + q_half, number_of_threads=256)

    @cute.jit
    def _turn_pass(self, q_half):
        """pingpong: hand the turn to the other consumer warpgroup (arrive on its barrier)."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + 1 - q_half,
                                     number_of_threads=256)

    @cute.jit
    def _mask(self, acc_s, tScS, kv0, pos0, seq_len, shift=None):
        """-inf where key position > query position (causal) or >= seq_len (ragged tail).
        Only pages reaching past the tile's first query position can hold masked keys.
        ``shift`` (unpacked_prefill variant): runtime row -> token shift."""
        if kv0 + self.page - 1 > pos0:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kv = kv0 + tScS[e][1]
                qpos = pos0 + self._row_token(tScS[e][0], shift)
                if kv > cutlass.min(qpos, seq_len - 1):
                    acc_s[e] = -cutlass.Float32.inf

    @cute.jit
    def _mask_limited(self, acc_s, tScS, kv0, pos0, kv_lim, shift=None):
        """kv_pair masking of a tile of ``kv_tile`` keys from ``kv0``: -inf where the key
        position is past the query's (causal) or past ``kv_lim``, the item's last valid key
        (``min(seq_len, p1 * P) - 1``; it also drops the copy an odd last stage holds)."""
        if kv0 + self.kv_tile - 1 > cutlass.min(pos0, kv_lim):
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kv = kv0 + tScS[e][1]
                qpos = pos0 + self._row_token(tScS[e][0], shift)
                if kv > cutlass.min(qpos, kv_lim):
                    acc_s[e] = -cutlass.Float32.inf

    @cute.jit
    def _unit_keys(self, u, n_old, ctx, seq_len):
        """(first key position, last valid key position) of KV unit ``u`` (fresh_kv)."""
        kv0 = u * self.page
        lim = ctx - 1
        if u >= n_old:
            kv0 = ctx + (u - n_old) * self.page
            lim = seq_len - 1
        return kv0, lim

    @cute.jit
    def _mask_unit_pair(self, acc_s, tScS, u, p1, n_old, ctx, pos0, seq_len, shift=None):
        """fresh_kv + kv_pair masking: columns ``0 .. P-1`` hold unit ``u``, columns
        ``P .. 2P-1`` unit ``u + 1``, each masked as ``_mask_unit`` masks it; when
        ``u + 1 >= p1`` the second half holds a copy of unit ``u`` and is masked whole."""
        P = self.page
        kv0a, lima = self._unit_keys(u, n_old, ctx, seq_len)
        kv0b, limb = self._unit_keys(u + 1, n_old, ctx, seq_len)
        if u + 1 >= p1:
            limb = cutlass.Int32(-1)
        reach = cutlass.max(kv0a + P - 1 - cutlass.min(pos0, lima),
                            kv0b + P - 1 - cutlass.min(pos0, limb))
        if reach > 0:
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                col = tScS[e][1]
                kv = kv0a + col
                lim = lima
                if col >= P:
                    kv = kv0b + col - P
                    lim = limb
                qpos = pos0 + self._row_token(tScS[e][0], shift)
                if kv > cutlass.min(qpos, lim):
                    acc_s[e] = -cutlass.Float32.inf

    @cute.jit
    def _mask_unit(self, acc_s, tScS, u, n_old, ctx, pos0, seq_len, shift, u_part, u_diag):
        """fresh_kv masking of KV unit ``u``.  Old page ``u < n_old``: key position
        ``u*P + c`` is valid iff ``< ctx`` (every query sits at >= ctx, so causality holds;
        the cache rows >= ctx are this step's and may be mid-writeback).  Fresh tile
        ``k = u - n_old``: key position ``ctx + k*P + c`` is valid iff ``<=`` the query's
        position (causal; also drops rows of the next request, which sit past seq_len).
        Only units ``u == u_part`` (the old page holding ``ctx``, when ``ctx % P != 0``)
        and ``u >= u_diag`` (fresh tiles reaching past the tile's first query position)
        can hold a masked key; both are loop-invariant (``planner.fresh_mask_units``), so
        the per-page test is two compares (the per-page form took ~10 instructions, which
        ptxas placed between the V-stage wait and the PV wgmma issue in the 16-byte-copy
        kernels: +1.5% on the H200, bench/notes.md, nineteenth session)."""
        if u == u_part or u >= u_diag:
            kv0 = u * self.page
            lim = ctx - 1
            if u >= n_old:
                kv0 = ctx + (u - n_old) * self.page
                lim = seq_len - 1
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                kv = kv0 + tScS[e][1]
                qpos = pos0 + self._row_token(tScS[e][0], shift)
                if kv > cutlass.min(qpos, lim):
                    acc_s[e] = -cutlass.Float32.inf

    @cute.jit
    def _row_token(self, row, shift):
        """Token of MMA row ``row``: ``row // Gp`` (packed, compile-time) or, in the
        unpacked_prefill variant, ``row >> shift`` with the item's runtime shift."""
        if cutlass.const_expr(shift is None):
            return row // self.group_pad
        else:
            return row >> shift

    @cute.jit
    def _store_tile(self, tma_s, mS_tma, s_tile, stage, box, row_mode: cutlass.Constexpr,
                    off, h, page, half=None):
        """TMA-store smem stage ``stage`` (a K or V tile) at row offset ``off >= 0`` (in mode
        ``row_mode`` of the box) of ``page``; tile rows past the page are clipped by the TMA
        bounds.  One elected thread issues it (the bulk-group state is per thread)."""
        o1 = [0, 0, 0, 0]
        o1[row_mode] = off
        g1 = cute.flat_divide(cute.domain_offset(tuple(o1), mS_tma), box)
        ts1, tg1 = cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
            cute.group_modes(g1, 0, 2))
        if cutlass.const_expr(half is None):
            with cute.arch.elect_one():
                cute.copy(tma_s, ts1[(None, stage)], tg1[(None, 0, 0, h, page)])
        else:
            # kv_pair: s_tile is the (rows, d, half, stage) view of the page boxes
            with cute.arch.elect_one():
                cute.copy(tma_s, ts1[(None, half, stage)], tg1[(None, 0, 0, h, page)])

    @cute.jit
    def _load_unit_half(self, tma_page, tgPage, tsPage, tma_fresh, mFresh_tma, s_tma, box,
                        row_mode: cutlass.Constexpr, unit, n_old, tok_base, b, h,
                        half: cutlass.Constexpr, handle, mBlockTable):
        """kv_pair + fresh_kv: KV unit ``unit`` (K with ``row_mode`` 0, V with 1) into half
        ``half`` of the stage ``handle`` holds: a cache page (``unit < n_old``) by the page
        atom, else fresh tile ``unit - n_old`` (new rows ``tok_base + k*P ..``) by the fresh
        atom, both completing on the stage's barrier."""
        if unit < n_old:
            page = mBlockTable[b, unit]
            cute.copy(tma_page, tgPage[(None, 0, 0, h, page)],
                      tsPage[(None, half, handle.index)], tma_bar_ptr=handle.barrier)
        else:
            tok = tok_base + (unit - n_old) * self.page
            o = [0, 0, 0]
            o[row_mode] = tok
            gF = cute.flat_divide(cute.domain_offset(tuple(o), mFresh_tma), box)
            tsF, tgF = cpasync.tma_partition(
                tma_fresh, 0, cute.make_layout(1), cute.group_modes(s_tma, 0, 2),
                cute.group_modes(gF, 0, 2))
            cute.copy(tma_fresh, tgF[(None, 0, 0, h)], tsF[(None, half, handle.index)],
                      tma_bar_ptr=handle.barrier)

    @cute.jit
    def _store_fresh_half(self, tma_ks, mKs_tma, tma_vs, mVs_tma, sK, sV, sK_tma, sV_tma,
                          mKc, mVc, k_handle, v_handle, half: cutlass.Constexpr, pos, seq_len,
                          h, b, mBlockTable, lane):
        """kv_pair + fresh_kv: store the owned fresh tile in half ``half`` of the stage
        (new tokens at positions ``pos ..``) into the cache, as the unpaired kernel stores
        a whole stage: wait for the stage's full barrier, TMA-store the rows of page
        ``pos // P`` from row offset ``pos % P``, and copy the valid rows that reach into
        the next page with plain stores."""
        P = self.page
        D = self.head_dim
        S = self.kv_stages
        pg = pos // P
        off = pos - pg * P
        two = cutlass.min(pos + P, seq_len) > (pg + 1) * P
        page1 = mBlockTable[b, pg]
        page2 = page1
        if two:
            page2 = mBlockTable[b, pg + 1]
        n2 = cutlass.min(pos + P, seq_len) - (pg + 1) * P
        r0 = half * P + P - off  # stage row of the first row that belongs to page pg + 1
        cute.arch.mbarrier_wait(k_handle.barrier, (k_handle.count // S) % 2)
        self._store_tile(tma_ks, mKs_tma, sK_tma, k_handle.index, (P, D), 0, off, h, page1,
                         half)
        if two:
            self._straddle(mKc, sK, k_handle.index, r0, n2, h, page2, lane, False)
        cute.arch.mbarrier_wait(v_handle.barrier, (v_handle.count // S) % 2)
        self._store_tile(tma_vs, mVs_tma, sV_tma, v_handle.index, (D, P), 1, off, h, page1,
                         half)
        if two:
            self._straddle(mVc, sV, v_handle.index, r0, n2, h, page2, lane, True)

    @staticmethod
    def _row_d(row, d, d_first: bool):
        """A (row, d) coordinate in a K/V tile's mode order: (row, d) for K's smem and cache
        views, (d, row) for V's (plain Python, resolved while tracing)."""
        return (d, row) if d_first else (row, d)

    @cute.jit
    def _straddle(self, mC, sX, stage, r0, n2, h, page2, lane, d_first: cutlass.Constexpr):
        """Copy fresh-tile rows ``r0 .. r0 + n2 - 1`` of K or V stage ``stage`` (smem
        ``sX``) into rows ``0 .. n2 - 1`` of cache page ``page2`` (``mC``: (row, d, head,
        page) for K, ``d_first`` (d, row, head, page) for V), by the 32 lanes of the
        producer warp: element-wise, or with ``vec_straddle`` 8 elements (16 bytes) of one
        row a lane an iteration."""
        D = self.head_dim
        if cutlass.const_expr(self.vec_straddle):
            # a lane moves STRADDLE_BATCH 16-byte chunks an iteration: all loads, then all
            # stores, so the shared-memory latency is paid once a batch (a load and its
            # store one after the other left the loop latency-bound: ~1.5 us a K or V
            # straddle on the H200).  Chunk indices past the end are clamped to the last
            # chunk: the clamped lanes store the same 16 bytes to the same place again.
            V8 = D // 8
            n = n2 * V8
            for i0 in cutlass.range(lane, n, 32 * STRADDLE_BATCH, unroll=1):
                vals = []
                for j in cutlass.range_constexpr(STRADDLE_BATCH):
                    i = cutlass.min(i0 + 32 * j, n - 1)
                    r = i // V8
                    src = cute.local_tile(sX[self._row_d(r0 + r, None, d_first) + (stage,)],
                                          (8,), (i - r * V8,))
                    vals.append(src.load())
                for j in cutlass.range_constexpr(STRADDLE_BATCH):
                    i = cutlass.min(i0 + 32 * j, n - 1)
                    r = i // V8
                    dst = cute.local_tile(mC[self._row_d(r, None, d_first) + (h, page2)],
                                          (8,), (i - r * V8,))
                    dst.store(vals[j])
        else:
            for i in cutlass.range(lane, n2 * D, 32, unroll=1):
                r = i // D
                c = i - r * D
                mC[self._row_d(r, c, d_first) + (h, page2)] = sX[
                    self._row_d(r0 + r, c, d_first) + (stage,)]

    @cute.jit
    def _online_softmax(self, acc_s, row_max, row_sum, corr, scale_log2):
        """In place: acc_s <- exp2(scale*(s - m_new)); row_sum <- row_sum*corr + sum; corr is
        the factor O must be multiplied by.  A thread holds two rows (slot 0/1): accumulator
        elements e with (e // 2) % 2 == slot, per the wgmma C-fragment layout; the other
        columns of a row live in the 3 other threads of the quad."""
        n_s = cute.size(acc_s)
        for slot in cutlass.range_constexpr(2):
            mx = row_max[slot]
            for e in cutlass.range_constexpr(n_s):
                if cutlass.const_expr((e // 2) % 2 == slot):
                    mx = cute.arch.fmax(mx, acc_s[e])
            mx = cute.arch.warp_reduction_max(mx, threads_in_group=4)
            if cutlass.const_expr(self.lazy_rescale):
                # keep the old max while the new one exceeds it by <= 2^8 in P; a first
                # finite max (old -inf) always moves it (-inf - -inf = NaN compares False)
                m_old = row_max[slot]
                corr[slot] = cutlass.Float32(1.0)
                if (mx - m_old) * scale_log2 > LAZY_RESCALE_LOG2:
                    corr[slot] = cute.math.exp2((m_old - mx) * scale_log2, fastmath=True)
                    m_old = mx
                mx = m_old
                m_use = mx
                if mx == -cutlass.Float32.inf:
                    m_use = cutlass.Float32(0.0)
            else:
                m_use = mx
                if mx == -cutlass.Float32.inf:
                    m_use = cutlass.Float32(0.0)
                corr[slot] = cute.math.exp2((row_max[slot] - m_use) * scale_log2, fastmath=True)
            m_scaled = m_use * scale_log2
            psum = cutlass.Float32(0.0)
            for e in cutlass.range_constexpr(n_s):
                if cutlass.const_expr((e // 2) % 2 == slot):
                    pe = cute.math.exp2(acc_s[e] * scale_log2 - m_scaled, fastmath=True)
                    acc_s[e] = pe
                    psum = psum + pe
            row_sum[slot] = row_sum[slot] * corr[slot] + psum
            row_max[slot] = mx

    @cute.jit
    def _rescale(self, acc_o, corr):
        for e in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[e] = acc_o[e] * corr[(e // 2) % 2]

    @cute.jit
    def _store_out(self, acc_o, tOcO, row_sum, mO, row0, q_cnt, group_size, tok_base, head_base,
                   shift=None, gmask=None):
        """O / l as 16-bit pairs: elements e, e+1 are columns c, c+1 of one row (4-byte store).
        ``shift``/``gmask`` (unpacked_prefill variant): row -> (token row >> shift, head
        head_base + (row & gmask)); unpacked items pass 0/0 and head_base = h*G + g."""
        mO_pairs = cute.recast_tensor(mO, cutlass.Uint32)   # (T, Hq, D/2)
        pair = cute.make_rmem_tensor((2,), self.dtype)
        pair_word = cute.recast_tensor(pair, cutlass.Uint32)
        for slot in cutlass.range_constexpr(2):
            row = row0 + slot * 8
            t_local = row // self.group_pad
            g = row % self.group_pad
            if cutlass.const_expr(shift is not None):
                t_local = row >> shift
                g = row & gmask
            inv = cutlass.Float32(0.0)
            if row_sum[slot] > 0.0:
                inv = cute.arch.rcp_approx(row_sum[slot])
            if t_local < q_cnt:
                if g < group_size:
                    tok = tok_base + t_local
                    head = head_base + g
                    for e in cutlass.range_constexpr(0, cute.size(acc_o), 2):
                        if cutlass.const_expr((e // 2) % 2 == slot):
                            pair[0] = (acc_o[e] * inv).to(self.dtype)
                            pair[1] = (acc_o[e + 1] * inv).to(self.dtype)
                            mO_pairs[tok, head, tOcO[e][1] // 2] = pair_word[0]

    @cute.jit
    def _store_partial(self, acc_o, tOcO, row_max, row_sum, mOPartial, mLsePartial, row0, q_cnt,
                       group_size, poff, scale_log2, shift=None, gmask=None, q_head=None,
                       poff_item=None, tok_u=None, split_idx=None, n_split=None,
                       ntok_item=None):
        """Split-KV partial: O / l (fp32) and lse2 = m * scale_log2 + log2(l) per packed row
        ``poff + t * Gp + g`` (layout shared with the planner and combine.py).
        unpacked_prefill variant (``shift``/``gmask`` and the rest given): row -> (token
        ``row >> shift``, slot ``row & gmask``) as in ``_store_out``; a packed item writes
        the packed row as above, an unpacked item (``q_head >= 0``, one q head) token ``t``
        of the item (``tok_u + row``) in chunk ``k = t // c`` (``c = 64 // Gp`` tokens,
        ``n_k = min(c, ntok_item - k * c)``) to ``poff_item + k * n_split * 64 +
        split_idx * n_k * Gp + (t % c) * Gp`` (``planner.partial_row``)."""
        log2_c = 6 - self.log2_gp
        for slot in cutlass.range_constexpr(2):
            row = row0 + slot * 8
            t_local = row // self.group_pad
            g = row % self.group_pad
            if cutlass.const_expr(shift is not None):
                t_local = row >> shift
                g = row & gmask
            if t_local < q_cnt:
                if g < group_size:
                    prow = poff + row
                    if cutlass.const_expr(shift is not None):
                        if q_head >= 0:
                            t_item = t_local + tok_u
                            k = t_item >> log2_c
                            n_k = cutlass.min(ntok_item - (k << log2_c), 1 << log2_c)
                            prow = (poff_item + k * (n_split << 6)
                                    + ((split_idx * n_k + (t_item & ((1 << log2_c) - 1)))
                                       << self.log2_gp))
                    inv = cutlass.Float32(0.0)
                    lse2 = -cutlass.Float32.inf
                    if row_sum[slot] > 0.0:
                        inv = cute.arch.rcp_approx(row_sum[slot])
                        lse2 = row_max[slot] * scale_log2 + cute.math.log2(row_sum[slot], fastmath=True)
                    if tOcO[0][1] == 0:
                        mLsePartial[prow] = lse2
                    for e in cutlass.range_constexpr(cute.size(acc_o)):
                        if cutlass.const_expr((e // 2) % 2 == slot):
                            mOPartial[prow, tOcO[e][1]] = acc_o[e] * inv
