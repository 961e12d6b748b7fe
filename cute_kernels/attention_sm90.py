"""IonAttention forward kernel for Hopper (sm_90a), written in CuTeDSL.

One persistent launch covers every row of a mixed prefill + decode batch over the paged KV
cache.  The host planner (``planner.py``) lists the items; CTA ``c`` walks items
``cta_offsets[c] : cta_offsets[c+1]`` of the work list (columns: ``worklist.py``).  An item
is one (request, KV head, q tile, KV range).

q tiles.  A *packed* tile puts ``64 // Gp`` new tokens times the ``Gp`` q heads of one KV
head (G rounded up to a power of two) into the 64 MMA rows of a warpgroup, so a decode row
with GQA 7 fills 7 of 8 rows per token.  An *unpacked* tile (work col QHEAD = g >= 0) is one
q head ``h*G + g`` times 64 consecutive tokens, for long prefill rows where G < Gp would
leave rows empty.  The row -> token map is a runtime shift (``row >> log2(Gp)`` packed,
``row`` unpacked).

Warp specialization (``KernelOptions.tile_m`` = 64 x consumer warpgroups):
  * warpgroup 0, the producer (``Sm90Producer``, load_sm90.py): warp 0 issues TMA loads of
    the Q tile and, per KV page, one K box and one V box (a page of one KV head is exactly
    one box of the HND cache), on the mbarriers of three pipelines (Q, K, V).
  * warpgroups 1.., the consumers (``mma`` below): S = Q K^T by wgmma from shared memory,
    online softmax in fp32 registers, P converted to 16 bits in registers, O += P V by
    wgmma.  Software pipelined: S_{p+1} is issued before O += P_p V_p, the softmax of
    S_{p+1} runs while that PV is on the tensor cores, and O is rescaled once it retired.
    With two or three consumers (128/192-row tiles, one CTA per SM) each computes 64 rows
    from its own Q buffer and all of them share every K/V stage.  With one consumer two
    CTAs share an SM, so one CTA's softmax also hides behind the other's MMAs.  The item
    walk is compiled twice, with and without the soft cap's and the sliding window's code,
    and a launch takes one by its (uniform) arguments: layers without either run the loop
    they ran before those features existed.
  * epilogue (``Sm90Epilogue``, epilogue_sm90.py): O / l to ``out``, or for a split-KV item
    O / l and the log2-sum-exp to the fp32 workspace that ``combine_sm90.py`` merges.

Eager KV writeback (``fresh_kv``).  Work cols P0/P1 then index KV *units*: with ``ctx =
seq_len - q_len`` cached tokens, units ``0 .. n_old-1`` (``n_old = ceil(ctx / P)``) are cache
pages and unit ``n_old + k`` is *fresh tile* k (key positions ``ctx + k*P ..``), loaded by
TMA straight from the step's new K/V.  The one item that owns a fresh tile
(``planner.fresh_tile_owned``) also stores it from shared memory into the cache, so no
separate cache-write kernel runs and no item reads the fresh region from the cache.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from . import worklist as W
from .epilogue_sm90 import Sm90Epilogue
from .load_sm90 import Sm90Producer
from .options import PAGE_SIZE, WARPGROUP_ROWS, KernelOptions

TILE_M = WARPGROUP_ROWS


class IonAttentionSm90(Sm90Producer, Sm90Epilogue):
    """The kernel of one ``KernelOptions``; ``__call__`` attends, ``fused`` (``fresh_kv``
    only) also writes the step's K/V into the cache."""

    def __init__(self, options: KernelOptions):
        self.options = options
        self.dtype = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[options.dtype]
        self.head_dim = options.head_dim
        self.group_pad = options.group_pad
        self.log2_gp = options.group_pad.bit_length() - 1
        self.page = PAGE_SIZE
        self.consumers = options.consumers
        self.threads = options.threads
        self.ctas_per_sm = options.ctas_per_sm
        self.kv_stages = options.kv_stages
        self.q_stages = options.q_stages
        # one 64-row Q buffer per consumer warpgroup per Q stage
        self.q_bufs = self.q_stages * self.consumers
        self.producer_regs, self.consumer_regs = options.registers
        self.fresh_kv = options.fresh_kv

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
        mWork: cute.Tensor,       # int32 [N, WORK_COLS]
        mOffsets: cute.Tensor,    # int32 [C+1]
        mPartialOffsets: cute.Tensor,  # int32 [N]: first workspace row of a split item, else -1
        mOPartial: cute.Tensor,   # fp32 [R, D]: split-KV partial outputs (normalised by own l)
        mLsePartial: cute.Tensor,  # fp32 [R]: split-KV partial log2-sum-exp (scaled units)
        mSinks2: cute.Tensor,     # fp32 [Hq]: attention sink logits x log2(e); -inf: none
        group_size: cutlass.Int32,
        softmax_scale_log2: cutlass.Float32,
        softcap: cutlass.Float32,     # logits soft cap (0: none)
        softcap_in: cutlass.Float32,  # softmax_scale / softcap
        window: cutlass.Int32,        # sliding window in tokens (0: none)
        num_ctas: cutlass.Int32,
        stream,
    ):
        if cutlass.const_expr(self.fresh_kv):
            raise TypeError("a fresh_kv IonAttentionSm90 is compiled through .fused(...)")
        self._host(mQ, mK, mV, mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets,
                   mPartialOffsets, mOPartial, mLsePartial, mSinks2, group_size,
                   softmax_scale_log2, softcap, softcap_in, window, num_ctas, stream, None,
                   None)

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
        mWork: cute.Tensor,       # P0/P1 are KV units (planner fresh_kv=True)
        mOffsets: cute.Tensor,
        mPartialOffsets: cute.Tensor,
        mOPartial: cute.Tensor,
        mLsePartial: cute.Tensor,
        mSinks2: cute.Tensor,
        group_size: cutlass.Int32,
        softmax_scale_log2: cutlass.Float32,
        softcap: cutlass.Float32,     # logits soft cap (0: none)
        softcap_in: cutlass.Float32,  # softmax_scale / softcap
        window: cutlass.Int32,        # sliding window in tokens (0: none)
        num_ctas: cutlass.Int32,
        stream,
    ):
        """Attention + eager KV writeback in one launch (``fresh_kv`` only)."""
        if cutlass.const_expr(not self.fresh_kv):
            raise TypeError("IonAttentionSm90.fused needs fresh_kv=True")
        self._host(mQ, mK, mV, mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets,
                   mPartialOffsets, mOPartial, mLsePartial, mSinks2, group_size,
                   softmax_scale_log2,
                   softcap, softcap_in, window, num_ctas, stream, mKey, mValue)

    @cute.jit
    def _host(self, mQ, mK, mV, mO, mQSL, mSeqLens, mBlockTable, mWork, mOffsets,
              mPartialOffsets, mOPartial, mLsePartial, mSinks2, group_size,
              softmax_scale_log2,
              softcap, softcap_in, window, num_ctas, stream, mKey, mValue):
        """Views, TMA atoms and shared-memory layouts, then the launch (inlined into
        ``__call__`` or ``fused`` at trace time)."""
        dt = self.dtype
        D = self.head_dim
        P = self.page
        Gp = self.group_pad
        TPT = TILE_M // Gp  # tokens of one 64-row packed Q box

        # Q as (head, token, d): a (Gp, TPT, D) box at head h*G is the packed tile
        q_view = cute.make_tensor(
            mQ.iterator,
            cute.make_layout((mQ.shape[1], mQ.shape[0], D), stride=(mQ.stride[1], mQ.stride[0], 1)),
        )
        # K as (row, d, head, page): K-major B operand of S = Q K^T
        k_view = cute.make_tensor(
            mK.iterator,
            cute.make_layout((P, D, mK.shape[1], mK.shape[0]),
                             stride=(mK.stride[2], 1, mK.stride[1], mK.stride[0])),
        )
        # V as (d, row, head, page): MN-major B operand of O = P V
        v_view = cute.make_tensor(
            mV.iterator,
            cute.make_layout((D, P, mV.shape[1], mV.shape[0]),
                             stride=(1, mV.stride[2], mV.stride[1], mV.stride[0])),
        )

        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
            cutlass.Float32, (1, 1, 1), (TILE_M, P))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (TILE_M, D), warpgroup.OperandSource.RMEM)

        q_smem_staged = sm90_utils.make_smem_layout_a(
            utils.LayoutEnum.ROW_MAJOR, (TILE_M, P, D), dt, self.q_bufs)
        k_smem_staged = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.ROW_MAJOR, (TILE_M, P, D), dt, self.kv_stages)
        v_smem_staged = sm90_utils.make_smem_layout_b(
            utils.LayoutEnum.COL_MAJOR, (TILE_M, D, P), dt, self.kv_stages)
        k_box_smem = cute.slice_(k_smem_staged, (None, None, 0))
        v_box_smem = cute.slice_(v_smem_staged, (None, None, 0))

        # packed Q box: smem rows r = t * Gp + g, viewed as (Gp, TPT, D)
        q_smem_one = cute.slice_(q_smem_staged, (None, None, 0))
        q_smem_box = cute.composition(
            q_smem_one, cute.make_layout((Gp, TPT, D), stride=(1, Gp, TILE_M)))
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q_view, q_smem_box, (Gp, TPT, D))
        # unpacked Q box: one head x TILE_M tokens, smem row r = token r
        q_smem_box_u = cute.composition(
            q_smem_one, cute.make_layout((1, TILE_M, D), stride=(1, 1, TILE_M)))
        tma_qu, tma_tensor_qu = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), q_view, q_smem_box_u, (1, TILE_M, D))
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
            # writeback: the same smem tiles stored into cache pages at a row offset; rows
            # outside the page are clipped by the TMA bounds of the row mode
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
            mLsePartial, mSinks2, group_size, softmax_scale_log2, softcap, softcap_in,
            window,
            q_smem_staged, q_smem_box, k_smem_staged, v_smem_staged, *fresh_args,
            tma_qu=tma_qu, mQu_tma=tma_tensor_qu, q_smem_box_u=q_smem_box_u,
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
        mSinks2: cute.Tensor,
        group_size: cutlass.Int32,
        scale_log2: cutlass.Float32,
        softcap: cutlass.Float32,
        softcap_in: cutlass.Float32,
        window: cutlass.Int32,
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
        tma_qu: cute.CopyAtom = None,     # the unpacked Q box (1 head x 64 tokens); always
        mQu_tma: cute.Tensor = None,      # given, by keyword after the optional fused
        q_smem_box_u: cute.ComposedLayout = None,  # arguments
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # a Q stage is one 64-row box per consumer warpgroup; every stage is released by
        # the 4 warps of each consumer warpgroup
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

        pipeline.pipeline_init_arrive(is_relaxed=True)
        pipeline.pipeline_init_wait()

        item_begin = mOffsets[bidx]
        item_end = mOffsets[bidx + 1]

        if wg_idx == 0:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp_idx == 0:
                self.load(tma_q, mQ_tma, tma_qu, mQu_tma, tma_k, mK_tma, tma_v, mV_tma,
                          mQSL, mSeqLens, mBlockTable, mWork, group_size, sQ, sK, sV,
                          q_smem_box, q_smem_box_u, q_prod, k_prod, v_prod,
                          item_begin, item_end, tidx, tma_kf, mKf_tma, tma_vf, mVf_tma,
                          tma_ks, mKs_tma, tma_vs, mVs_tma, mKc, mVc)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            self.mma(qk_mma, pv_mma, mO, mQSL, mSeqLens, mWork, mPartialOffsets, mOPartial,
                     mLsePartial, mSinks2, group_size, scale_log2, softcap, softcap_in, window,
                     sQ, sK, sV, q_cons, k_cons, v_cons, item_begin, item_end, tidx, wg_idx)

    @staticmethod
    def _tma_pipeline(barriers, stages: int, tx_bytes: int, consumer_arrivals: int):
        """mbarrier pipeline: one TMA-issuing producer thread; the consumer side is released
        by lane 0 of every consumer warp (PipelineTmaAsync signals once per warp)."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_arrivals),
            tx_count=tx_bytes,
            defer_sync=True,
        )

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def mma(self, qk_mma, pv_mma, mO, mQSL, mSeqLens, mWork, mPartialOffsets, mOPartial,
            mLsePartial, mSinks2, group_size, scale_log2, softcap, softcap_in, window, sQ,
            sK, sV,
            q_cons, k_cons, v_cons, item_begin, item_end, tidx, wg_idx):
        """A consumer warpgroup's walk over the CTA's items: main loop, then epilogue."""
        D = self.head_dim
        P = self.page
        # consumer warpgroup w = 1.. computes rows 64*(w-1) .. +63 of the q tile from Q
        # buffer consumers * stage + (w - 1)
        ctid = tidx - 128
        q_half = 0
        if cutlass.const_expr(self.consumers >= 2):
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
        acc_s = qk_thr.make_fragment_C(qk_thr.partition_shape_C((TILE_M, P)))
        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((TILE_M, D)))
        tScS = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, P)))
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((TILE_M, D)))
        rP = cute.make_rmem_tensor(pv_thr.partition_shape_A((TILE_M, P)), self.dtype)
        rP_as_s = cute.make_tensor(rP.iterator, acc_s.layout)
        row_max = cute.make_rmem_tensor((2,), cutlass.Float32)
        row_sum = cute.make_rmem_tensor((2,), cutlass.Float32)
        corr = cute.make_rmem_tensor((2,), cutlass.Float32)

        # the item walk is unswitched on the layer's logit features (uniform over the
        # launch): a layer without soft cap or window runs a copy without their code
        has_features = cutlass.Int32(0)
        if softcap > 0.0:
            has_features = cutlass.Int32(1)
        if window > 0:
            has_features = cutlass.Int32(1)
        if has_features != 0:
            self._walk(qk_mma, pv_mma, tSrQ, tSrK, tOrV, acc_s, acc_o, rP_as_s, rP, tScS,
                       tOcO, row_max, row_sum, corr, q_cons, k_cons, v_cons, mO, mQSL,
                       mSeqLens, mWork, mPartialOffsets, mOPartial, mLsePartial, mSinks2,
                       group_size, scale_log2, softcap, softcap_in, window, item_begin,
                       item_end, q_half, True)
        else:
            self._walk(qk_mma, pv_mma, tSrQ, tSrK, tOrV, acc_s, acc_o, rP_as_s, rP, tScS,
                       tOcO, row_max, row_sum, corr, q_cons, k_cons, v_cons, mO, mQSL,
                       mSeqLens, mWork, mPartialOffsets, mOPartial, mLsePartial, mSinks2,
                       group_size, scale_log2, softcap, softcap_in, window, item_begin,
                       item_end, q_half, False)

    @cute.jit
    def _walk(self, qk_mma, pv_mma, tSrQ, tSrK, tOrV, acc_s, acc_o, rP_as_s, rP, tScS, tOcO,
              row_max, row_sum, corr, q_cons, k_cons, v_cons, mO, mQSL, mSeqLens, mWork,
              mPartialOffsets, mOPartial, mLsePartial, mSinks2, group_size, scale_log2,
              softcap, softcap_in, window, item_begin, item_end, q_half,
              features: cutlass.Constexpr):
        """The consumer warpgroup's items: each one's main loop (``_attend``), then its
        epilogue.  ``features``: the copy for layers with a soft cap or a window."""
        P = self.page
        for it in cutlass.range(item_begin, item_end, 1, unroll=1):
            b = mWork[it, W.REQ]
            h = mWork[it, W.HEAD]
            q_start = mWork[it, W.QSTART]
            q_cnt = mWork[it, W.QLEN]
            p0 = mWork[it, W.P0]
            p1 = mWork[it, W.P1]
            seq_len = mSeqLens[b]
            q_len = mQSL[b + 1] - mQSL[b]
            # absolute position of the tile's first token
            pos0 = seq_len - q_len + q_start
            # row -> (token, q head): packed rows r = t * Gp + g; unpacked rows r = t
            qh = mWork[it, W.QHEAD]
            head_base = h * group_size
            shift = cutlass.Int32(self.log2_gp)
            gmask = cutlass.Int32(self.group_pad - 1)
            if qh >= 0:
                shift = cutlass.Int32(0)
                gmask = cutlass.Int32(0)
                head_base = head_base + qh
            poff_rows = 0
            tok_off = 0
            if cutlass.const_expr(self.consumers >= 2):
                # this warpgroup's rows as a 64-row tile: its first token is tok_off tokens
                # into the item, it holds q_cnt - tok_off of the item's tokens (<= 0: none,
                # nothing is stored) and its workspace rows start 64*(w-1) rows further
                poff_rows = q_half * TILE_M
                tok_off = poff_rows >> shift
                pos0 = pos0 + tok_off
                q_start = q_start + tok_off
                q_cnt = q_cnt - tok_off
            ctx = 0
            n_old = 0
            u_part = 0
            u_diag = 0
            if cutlass.const_expr(self.fresh_kv):
                # units < n_old are cache pages, the rest fresh tiles; only units u_part and
                # >= u_diag can hold a masked key (planner.fresh_mask_units states the rule)
                ctx = seq_len - q_len
                n_old = (ctx + P - 1) // P
                u_part = cutlass.Int32(-1)
                if n_old * P != ctx:
                    u_part = n_old - 1
                u_diag = n_old + (cutlass.min(pos0, seq_len - 1) - ctx + 1) // P
            row_max[0] = -cutlass.Float32.inf
            row_max[1] = -cutlass.Float32.inf
            row_sum[0] = cutlass.Float32(0.0)
            row_sum[1] = cutlass.Float32(0.0)
            acc_o.fill(0.0)
            q_cons, k_cons, v_cons = self._attend(
                qk_mma, pv_mma, tSrQ, tSrK, tOrV, acc_s, acc_o, rP_as_s, rP, tScS, row_max,
                row_sum, corr, q_cons, k_cons, v_cons, q_half, p0, p1, pos0, seq_len, shift,
                n_old, ctx, u_part, u_diag, scale_log2, softcap, softcap_in, window, features)

            self.epilogue(acc_o, tOcO, row_max, row_sum, mO, mQSL, mWork, mPartialOffsets,
                          mOPartial, mLsePartial, mSinks2, it, b, q_start, q_cnt, head_base,
                          shift,
                          gmask, qh, poff_rows, tok_off, group_size, scale_log2)

    @cute.jit
    def _attend(self, qk_mma, pv_mma, tSrQ, tSrK, tOrV, acc_s, acc_o, rP_as_s, rP, tScS,
                row_max, row_sum, corr, q_cons, k_cons, v_cons, q_half, p0, p1, pos0,
                seq_len, shift, n_old, ctx, u_part, u_diag, scale_log2, softcap, softcap_in,
                window, features: cutlass.Constexpr):
        """One item's main loop: O, row max and row sum over pages (units) p0 .. p1-1.
        ``features``: the layer has a soft cap or a sliding window (else their code is not
        compiled into this copy).  Returns the Q, K and V consumers, advanced."""
        P = self.page
        # sliding window: a key kv is masked for the query at qpos iff kv <= qpos - w_off;
        # only pages (units) <= u_win can hold such a key: the one holding key kw = last
        # query position - window, and before (u_win = -1: none)
        w_off = cutlass.Int32(1 << 30)
        u_win = cutlass.Int32(-1)
        if cutlass.const_expr(features):
            if window > 0:
                w_off = window
                kw = pos0 + (TILE_M >> shift) - 1 - window
                if kw >= 0:
                    u_win = kw // P
                    if cutlass.const_expr(self.fresh_kv):
                        if kw >= ctx:
                            u_win = n_old + (kw - ctx) // P

        q_handle = q_cons.wait_and_advance()
        q_buf = q_handle.index
        if cutlass.const_expr(self.consumers >= 2):
            q_buf = q_handle.index * self.consumers + q_half
        # first page: S = Q K^T, softmax -> P
        k_handle = k_cons.wait_and_advance()
        self._issue_qk(qk_mma, acc_s, tSrQ, tSrK, q_buf, k_handle.index)
        cute.nvgpu.warpgroup.wait_group(0)
        k_handle.release()
        if cutlass.const_expr(features):
            if softcap > 0.0:
                self._soft_cap(acc_s, softcap, softcap_in)
        self._mask_kv(acc_s, tScS, p0, pos0, seq_len, shift, n_old, ctx, u_part, u_diag,
                      u_win, w_off, features)
        self._online_softmax(acc_s, row_max, row_sum, corr, scale_log2)
        rP_as_s.store(acc_s.load().to(self.dtype))
        # steady state: S_p = Q K_p^T runs on the tensor cores while P_{p-1} is consumed
        # by O += P V_{p-1}; O is rescaled once that PV is done
        for p in cutlass.range(p0 + 1, p1, 1, unroll=1):
            k_handle = k_cons.wait_and_advance()
            self._issue_qk(qk_mma, acc_s, tSrQ, tSrK, q_buf, k_handle.index)
            v_handle = v_cons.wait_and_advance()
            self._issue_pv(pv_mma, acc_o, rP, tOrV, v_handle.index)
            cute.nvgpu.warpgroup.wait_group(1)
            k_handle.release()
            if cutlass.const_expr(features):
                if softcap > 0.0:
                    self._soft_cap(acc_s, softcap, softcap_in)
            self._mask_kv(acc_s, tScS, p, pos0, seq_len, shift, n_old, ctx, u_part,
                          u_diag, u_win, w_off, features)
            self._online_softmax(acc_s, row_max, row_sum, corr, scale_log2)
            cute.nvgpu.warpgroup.wait_group(0)
            v_handle.release()
            self._rescale(acc_o, corr)
            rP_as_s.store(acc_s.load().to(self.dtype))
        v_handle = v_cons.wait_and_advance()
        self._issue_pv(pv_mma, acc_o, rP, tOrV, v_handle.index)
        cute.nvgpu.warpgroup.wait_group(0)
        v_handle.release()
        q_handle.release()
        return q_cons, k_cons, v_cons

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
    def _mask_kv(self, acc_s, tScS, u, pos0, seq_len, shift, n_old, ctx, u_part, u_diag,
                 u_win, w_off, features: cutlass.Constexpr = True):
        """-inf on the keys of KV page (fused: unit) ``u`` that row's query may not see.

        Pages: key ``u*P + c`` is masked past the query's position (causal) or past
        ``seq_len``; only pages reaching past the tile's first query position hold one.
        Fused units: old page ``u < n_old`` holds keys ``u*P + c``, valid iff ``< ctx`` (the
        cache rows >= ctx are this step's, possibly mid-writeback); fresh tile ``u - n_old``
        holds keys ``ctx + (u-n_old)*P + c``, valid iff ``<=`` the query's position.  Only
        ``u == u_part`` and ``u >= u_diag`` can hold a masked key: two compares a page
        instead of the per-page arithmetic, which ptxas scheduled between the V wait and
        the PV wgmma.  A sliding window masks keys ``<= qpos - w_off`` on units ``<= u_win``
        (the item's first ones; ``u_win`` = -1 without a window)."""
        P = self.page
        # a window page takes the loop with both bounds; every other page keeps the causal
        # loop alone; without ``features`` (no window) the window test is not compiled
        if cutlass.const_expr(not features):
            self._mask_causal(acc_s, tScS, u, pos0, seq_len, shift, n_old, ctx, u_part,
                              u_diag)
        else:
            if u <= u_win:
                if cutlass.const_expr(self.fresh_kv):
                    kv0, lim = self._unit_keys(u, n_old, ctx, seq_len)
                    self._mask_keys(acc_s, tScS, kv0, lim, pos0, shift, w_off)
                else:
                    self._mask_keys(acc_s, tScS, u * P, seq_len - 1, pos0, shift, w_off)
            else:
                self._mask_causal(acc_s, tScS, u, pos0, seq_len, shift, n_old, ctx, u_part,
                                  u_diag)

    @cute.jit
    def _mask_causal(self, acc_s, tScS, u, pos0, seq_len, shift, n_old, ctx, u_part, u_diag):
        """``_mask_kv`` of a layer without a window: the causal and length bounds only."""
        P = self.page
        if cutlass.const_expr(self.fresh_kv):
            if u == u_part or u >= u_diag:
                kv0, lim = self._unit_keys(u, n_old, ctx, seq_len)
                self._mask_keys(acc_s, tScS, kv0, lim, pos0, shift, None)
        else:
            kv0 = u * P
            if kv0 + P - 1 > pos0:
                self._mask_keys(acc_s, tScS, kv0, seq_len - 1, pos0, shift, None)

    @cute.jit
    def _unit_keys(self, u, n_old, ctx, seq_len):
        """(first key, last valid key) of fused unit ``u``: old page ``u < n_old`` holds keys
        ``u*P ..`` valid below ``ctx``; fresh tile ``u - n_old`` keys ``ctx + (u-n_old)*P ..``
        valid below ``seq_len``."""
        P = self.page
        kv0 = u * P
        lim = ctx - 1
        if u >= n_old:
            kv0 = ctx + (u - n_old) * P
            lim = seq_len - 1
        return kv0, lim

    @cute.jit
    def _mask_keys(self, acc_s, tScS, kv0, lim, pos0, shift, w_off):
        """-inf where key ``kv0 + column`` lies past ``min(query position, lim)``, and with
        a window (``w_off`` not None) where it lies at or before ``query position - w_off``."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            kv = kv0 + tScS[e][1]
            qpos = pos0 + (tScS[e][0] >> shift)
            if cutlass.const_expr(w_off is None):
                if kv > cutlass.min(qpos, lim):
                    acc_s[e] = -cutlass.Float32.inf
            else:
                if kv > cutlass.min(qpos, lim) or kv <= qpos - w_off:
                    acc_s[e] = -cutlass.Float32.inf

    @cute.jit
    def _soft_cap(self, acc_s, cap, cap_in):
        """Gemma 2's logits soft cap on raw scores: s <- cap * tanh(s * scale / cap).  The
        host then passes scale_log2 = log2(e): the scale is inside the capped score.  A
        runtime branch (uniform over the launch), so the compile key does not grow."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[e] = cap * cute.math.tanh(acc_s[e] * cap_in, approx=True)

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
