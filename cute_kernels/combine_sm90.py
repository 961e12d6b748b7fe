"""Split-KV combine pass (CuTeDSL): merges the fp32 partials of split (b, h, q tile) groups.

Group row ``(b, h, tok0, ntok, S, base)`` (planner ``Plan.combine``): split ``s`` of packed row
``r = t * Gp + g`` lives at workspace row ``base + s * ntok * Gp + r`` holding ``O_s / l_s`` and
``lse2_s = m_s * scale_log2 + log2(l_s)``.  The exact merge is

    out = sum_s 2^(lse2_s - M) * O_s / sum_s 2^(lse2_s - M),   M = max_s lse2_s

written as 16-bit into ``out[qsl[b] + tok0 + t, h * G + g, :]``.  The grid is fixed (a
persistent loop over the group buffer's capacity, padding rows have ntok == 0), so the launch
is CUDA-graph safe.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

C_REQ, C_HEAD, C_TOK0, C_NTOK, C_NSPLIT, C_BASE = range(6)


class CombineSm90:
    def __init__(self, dtype, head_dim: int, group_pad: int, pdl: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.group_pad = group_pad
        self.threads = 128
        #: programmatic dependent launch: the grid may start while the attention kernel
        #: before it (which triggers early) still runs; every thread first waits at
        #: griddepcontrol.wait, which returns once that grid has completed and its memory
        #: is visible, so the partials are never read early.
        self.pdl = bool(pdl)

    @cute.jit
    def __call__(self, mO: cute.Tensor, mQSL: cute.Tensor, mCombine: cute.Tensor,
                 mOPartial: cute.Tensor, mLsePartial: cute.Tensor, group_size: cutlass.Int32,
                 num_ctas: cutlass.Int32, stream):
        self.kernel(mO, mQSL, mCombine, mOPartial, mLsePartial, group_size).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
            use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mQSL: cute.Tensor, mCombine: cute.Tensor,
               mOPartial: cute.Tensor, mLsePartial: cute.Tensor, group_size: cutlass.Int32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        D = self.head_dim
        Gp = self.group_pad
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        # threads split as (rows in flight) x (columns): D=128 -> 1 x 128, D=64 -> 2 x 64
        rows_per_pass = self.threads // D
        col = tidx % D
        sub = tidx // D
        n_groups = mCombine.shape[0]
        for gi in cutlass.range(bidx, n_groups, gdim, unroll=1):
            ntok = mCombine[gi, C_NTOK]
            if ntok > 0:
                b = mCombine[gi, C_REQ]
                h = mCombine[gi, C_HEAD]
                n_split = mCombine[gi, C_NSPLIT]
                base = mCombine[gi, C_BASE]
                tok_base = mQSL[b] + mCombine[gi, C_TOK0]
                split_stride = ntok * Gp
                n_rows = ntok * group_size
                for r in cutlass.range(sub, n_rows, rows_per_pass, unroll=1):
                    t = r // group_size
                    g = r % group_size
                    prow = base + t * Gp + g
                    m = -cutlass.Float32.inf
                    for s in cutlass.range(n_split, unroll=1):
                        m = cute.arch.fmax(m, mLsePartial[prow + s * split_stride])
                    if m == -cutlass.Float32.inf:
                        m = cutlass.Float32(0.0)
                    num = cutlass.Float32(0.0)
                    den = cutlass.Float32(0.0)
                    for s in cutlass.range(n_split, unroll=1):
                        w = cute.math.exp2(mLsePartial[prow + s * split_stride] - m, fastmath=True)
                        num = num + w * mOPartial[prow + s * split_stride, col]
                        den = den + w
                    res = cutlass.Float32(0.0)
                    if den > 0.0:
                        res = num / den
                    mO[tok_base + t, h * group_size + g, col] = res.to(self.dtype)


class CombineRowsSm90(CombineSm90):
    """Row-parallel variant of :class:`CombineSm90` (same arguments, same result).

    ``CombineSm90`` gives a group to a CTA and walks its rows one after another, and each row
    walks its splits one dependent load at a time, so a batch of few, long decode rows (8
    requests x 32k tokens: 32 groups of 7 rows x 8 splits) leaves 232 of 264 CTAs idle and
    the rest in a chain of ~170 dependent loads.  Here each of the CTA's 4 warps merges its
    own row (lanes cover D, 32 consecutive columns per load), the split loops are unrolled
    so their loads are in flight together, and a CTA stops at the first padding group
    (``ntok == 0``: the planner packs groups at the front and ``DevicePlan.upload`` zeroes the
    rest), instead of striding over the whole group buffer.
    """

    # the launch (__call__, 128 threads) is CombineSm90's; only the kernel body differs.
    # The group walk below is shared with CombineLanesSm90, which overrides how one row is
    # merged (_merge_row) and its per-thread scratch (_row_scratch).

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mQSL: cute.Tensor, mCombine: cute.Tensor,
               mOPartial: cute.Tensor, mLsePartial: cute.Tensor, group_size: cutlass.Int32):
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        Gp = self.group_pad
        K = self.head_dim // 32  # columns per lane: lane + 32 * j
        warps = self.threads // 32  # one row per warp
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        cap = mCombine.shape[0]
        acc = cute.make_rmem_tensor((K,), cutlass.Float32)
        scratch = self._row_scratch(K)
        gi = bidx
        ntok = cutlass.Int32(0)
        if gi < cap:
            ntok = mCombine[gi, C_NTOK]
        while ntok > 0:
            b = mCombine[gi, C_REQ]
            h = mCombine[gi, C_HEAD]
            n_split = mCombine[gi, C_NSPLIT]
            base = mCombine[gi, C_BASE]
            tok_base = mQSL[b] + mCombine[gi, C_TOK0]
            split_stride = ntok * Gp
            n_rows = ntok * group_size
            for r in cutlass.range(warp, n_rows, warps, unroll=1):
                t = r // group_size
                g = r - t * group_size
                self._merge_row(mO, mOPartial, mLsePartial, acc, scratch, base + t * Gp + g,
                                n_split, split_stride, lane, tok_base + t, h * group_size + g)
            gi = gi + gdim
            ntok = cutlass.Int32(0)
            if gi < cap:
                ntok = mCombine[gi, C_NTOK]

    def _row_scratch(self, K: int):
        """Per-thread registers a row merge needs besides ``acc`` (none here)."""
        return None

    @cute.jit
    def _merge_row(self, mO: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
                   acc: cute.Tensor, scratch, prow: cutlass.Int32, n_split: cutlass.Int32,
                   split_stride: cutlass.Int32, lane: cutlass.Int32, out_tok: cutlass.Int32,
                   out_head: cutlass.Int32):
        """Merge the ``n_split`` partials of workspace row ``prow`` into
        ``mO[out_tok, out_head, :]`` (lane ``l`` holds columns ``l + 32 j``)."""
        K = self.head_dim // 32
        m = -cutlass.Float32.inf
        for s in cutlass.range(n_split, unroll=4):
            m = cute.arch.fmax(m, mLsePartial[prow + s * split_stride])
        if m == -cutlass.Float32.inf:
            m = cutlass.Float32(0.0)
        den = cutlass.Float32(0.0)
        acc.fill(0.0)
        for s in cutlass.range(n_split, unroll=4):
            w = cute.math.exp2(mLsePartial[prow + s * split_stride] - m, fastmath=True)
            den = den + w
            for j in cutlass.range_constexpr(K):
                acc[j] = acc[j] + w * mOPartial[prow + s * split_stride, lane + 32 * j]
        inv = cutlass.Float32(0.0)
        if den > 0.0:
            inv = cutlass.Float32(1.0) / den
        for j in cutlass.range_constexpr(K):
            mO[out_tok, out_head, lane + 32 * j] = (acc[j] * inv).to(self.dtype)


class CombineLanesSm90(CombineRowsSm90):
    """Split-parallel variant of :class:`CombineRowsSm90` (same arguments, same result).

    ``CombineRowsSm90`` walks a row's splits in loops unrolled x4: the lse loads of splits
    4..7 issue only after the max of splits 0..3 is taken, and the partial-O loads only after
    the whole max, so an 8-way split costs about four dependent L2 round trips per row (the
    H200 measured decode 8 x 32768, 8 splits, at 137-138 us against 133-136 for 32 x 8192,
    2 splits, on the same attention items). Here lane ``s`` of the row's warp loads
    ``lse_s``, the partial O of the first ``SPLITS_IN_FLIGHT`` splits is loaded right after
    it, before any value is used, and the max is a warp reduction (shuffles, no memory).
    Each split's weight ``2^(lse_s - M)`` reaches every lane by shuffle from lane ``s``. A
    row of up to 8 splits costs one round trip, 16 splits two. Splits past 32 lanes, which
    the planner's ``max_splits`` (16) never makes, are still merged exactly on a slower path
    that reloads their lse.
    """

    #: splits whose partial O rows are loaded together (registers: SPLITS_IN_FLIGHT * D / 32)
    SPLITS_IN_FLIGHT = 8

    def _row_scratch(self, K: int):
        """The partial O of SPLITS_IN_FLIGHT splits, loaded together."""
        return cute.make_rmem_tensor((self.SPLITS_IN_FLIGHT * K,), cutlass.Float32)

    @cute.jit
    def _merge_row(self, mO: cute.Tensor, mOPartial: cute.Tensor, mLsePartial: cute.Tensor,
                   acc: cute.Tensor, scratch, prow: cutlass.Int32, n_split: cutlass.Int32,
                   split_stride: cutlass.Int32, lane: cutlass.Int32, out_tok: cutlass.Int32,
                   out_head: cutlass.Int32):
        K = self.head_dim // 32
        S = self.SPLITS_IN_FLIGHT
        vals = scratch
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
        inv = cutlass.Float32(0.0)
        if den > 0.0:
            inv = cutlass.Float32(1.0) / den
        for j in cutlass.range_constexpr(K):
            mO[out_tok, out_head, lane + 32 * j] = (acc[j] * inv).to(self.dtype)
