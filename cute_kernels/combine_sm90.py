"""Split-KV combine pass (CuTeDSL): merges the fp32 partials of split groups.

Group row ``(b, h, tok0, ntok, S, base)`` (``planner.Plan.combine``, columns in
``worklist.py``): split ``s`` of packed row ``r = t * Gp + g`` lives at workspace row
``base + s * ntok * Gp + r`` holding ``O_s / l_s`` and ``lse2_s = m_s * scale_log2 +
log2(l_s)``.  The exact merge is

    out = sum_s 2^(lse2_s - M) * O_s / sum_s 2^(lse2_s - M),   M = max_s lse2_s

written as 16-bit into ``out[qsl[b] + tok0 + t, h * G + g, :]``.

One warp merges one row.  Lane ``s`` loads ``lse_s``, and the partial O rows of the first
``SPLITS_IN_FLIGHT`` splits are loaded right after, before any value is used, so a row of
up to 8 splits costs one dependent L2 round trip; the max is a warp reduction, and each
split's weight reaches every lane by shuffle from lane ``s``.  Splits past 32 lanes, which
the planner's ``max_splits`` (16) never makes, are still merged exactly on a slower path.
The grid is fixed; a CTA walks groups ``bidx, bidx + grid, ...`` and stops at the first
padding group (``ntok == 0``: the planner packs groups at the front and
``DevicePlan.upload`` zeroes the rest), so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from . import worklist as W


class CombineSm90:
    #: splits whose partial O rows are loaded together (registers: SPLITS_IN_FLIGHT * D / 32)
    SPLITS_IN_FLIGHT = 8
    THREADS = 128

    def __init__(self, dtype, head_dim: int, group_pad: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.group_pad = group_pad

    @cute.jit
    def __call__(self, mO: cute.Tensor, mQSL: cute.Tensor, mCombine: cute.Tensor,
                 mOPartial: cute.Tensor, mLsePartial: cute.Tensor, mSinks2: cute.Tensor,
                 group_size: cutlass.Int32, num_ctas: cutlass.Int32, stream):
        self.kernel(mO, mQSL, mCombine, mOPartial, mLsePartial, mSinks2, group_size).launch(
            grid=[num_ctas, 1, 1], block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mQSL: cute.Tensor, mCombine: cute.Tensor,
               mOPartial: cute.Tensor, mLsePartial: cute.Tensor, mSinks2: cute.Tensor,
               group_size: cutlass.Int32):
        Gp = self.group_pad
        K = self.head_dim // 32  # columns per lane: lane + 32 * j
        warps = self.THREADS // 32  # one row per warp
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        cap = mCombine.shape[0]
        acc = cute.make_rmem_tensor((K,), cutlass.Float32)
        vals = cute.make_rmem_tensor((self.SPLITS_IN_FLIGHT * K,), cutlass.Float32)
        gi = bidx
        ntok = cutlass.Int32(0)
        if gi < cap:
            ntok = mCombine[gi, W.C_NTOK]
        while ntok > 0:
            b = mCombine[gi, W.C_REQ]
            h = mCombine[gi, W.C_HEAD]
            n_split = mCombine[gi, W.C_NSPLIT]
            base = mCombine[gi, W.C_BASE]
            tok_base = mQSL[b] + mCombine[gi, W.C_TOK0]
            split_stride = ntok * Gp
            n_rows = ntok * group_size
            for r in cutlass.range(warp, n_rows, warps, unroll=1):
                t = r // group_size
                g = r - t * group_size
                self._merge_row(mO, mOPartial, mLsePartial, mSinks2, acc, vals,
                                base + t * Gp + g, n_split, split_stride, lane, tok_base + t,
                                h * group_size + g)
            gi = gi + gdim
            ntok = cutlass.Int32(0)
            if gi < cap:
                ntok = mCombine[gi, W.C_NTOK]

    @cute.jit
    def _merge_row(self, mO: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
                   mSinks2: cute.Tensor, acc: cute.Tensor, vals: cute.Tensor,
                   prow: cutlass.Int32,
                   n_split: cutlass.Int32, split_stride: cutlass.Int32, lane: cutlass.Int32,
                   out_tok: cutlass.Int32, out_head: cutlass.Int32):
        """Merge the ``n_split`` partials of workspace row ``prow`` into
        ``mO[out_tok, out_head, :]`` (lane ``l`` holds columns ``l + 32 j``).  The q head's
        attention sink (``mSinks2``, log2 units; -inf: none) joins the denominator."""
        K = self.head_dim // 32
        S = self.SPLITS_IN_FLIGHT
        # 1. lane s: lse of split s; then the partial O of the first S splits, all issued
        #    before any of them is used
        lse = -cutlass.Float32.inf
        if lane < n_split:
            lse = mLsePartial[prow + lane * split_stride]
        for k in cutlass.range_constexpr(S):
            for j in cutlass.range_constexpr(K):
                vals[k * K + j] = cutlass.Float32(0.0)
            if k < n_split:
                for j in cutlass.range_constexpr(K):
                    vals[k * K + j] = mOPartial[prow + k * split_stride, lane + 32 * j]
        # 2. the row max over every split (lanes hold splits 0..31, then a slow path)
        m = lse
        for s in cutlass.range(lane + 32, n_split, 32, unroll=1):
            m = cute.arch.fmax(m, mLsePartial[prow + s * split_stride])
        m = cute.arch.warp_reduction_max(m)
        sink2 = mSinks2[out_head]
        m = cute.arch.fmax(m, sink2)
        if m == -cutlass.Float32.inf:
            m = cutlass.Float32(0.0)
        w = cute.math.exp2(lse - m, fastmath=True)  # 0 on lanes past n_split
        # 3. merge: split s's weight comes from lane s by shuffle
        den = cutlass.Float32(0.0)
        acc.fill(0.0)
        for k in cutlass.range_constexpr(S):
            ws = cute.arch.shuffle_sync(w, k)
            den = den + ws
            for j in cutlass.range_constexpr(K):
                acc[j] = acc[j] + ws * vals[k * K + j]
        # later chunks of S splits (n_split > S), loaded together the same way
        for s0 in cutlass.range(S, n_split, S, unroll=1):
            for k in cutlass.range_constexpr(S):
                for j in cutlass.range_constexpr(K):
                    vals[k * K + j] = cutlass.Float32(0.0)
                if s0 + k < n_split:
                    for j in cutlass.range_constexpr(K):
                        vals[k * K + j] = mOPartial[prow + (s0 + k) * split_stride,
                                                    lane + 32 * j]
            for k in cutlass.range_constexpr(S):
                ws = cutlass.Float32(0.0)
                if s0 + k < 32:  # warp-uniform; lanes past n_split hold w = 0
                    ws = cute.arch.shuffle_sync(w, s0 + k)
                elif s0 + k < n_split:
                    ws = cute.math.exp2(
                        mLsePartial[prow + (s0 + k) * split_stride] - m, fastmath=True)
                den = den + ws
                for j in cutlass.range_constexpr(K):
                    acc[j] = acc[j] + ws * vals[k * K + j]
        den = den + cute.math.exp2(sink2 - m, fastmath=True)  # 0 without a sink
        inv = cutlass.Float32(0.0)
        if den > 0.0:
            inv = cutlass.Float32(1.0) / den
        for j in cutlass.range_constexpr(K):
            mO[out_tok, out_head, lane + 32 * j] = (acc[j] * inv).to(self.dtype)
