"""Epilogue of the IonAttention consumers: an item's O / l to ``out``, or, for a split-KV
item, O / l and its log2-sum-exp to the fp32 workspace (rows: ``planner.partial_row``)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from . import worklist as W


class Sm90Epilogue:
    """Mixin of ``IonAttentionSm90``: uses its ``dtype``, ``group_pad``, ``log2_gp`` and
    ``consumers``."""

    @cute.jit
    def epilogue(self, acc_o, tOcO, row_max, row_sum, mO, mQSL, mWork, mPartialOffsets,
                 mOPartial, mLsePartial, mSinks2, it, b, q_start, q_cnt, head_base, shift,
                 gmask, qh, poff_rows, tok_off, group_size, scale_log2):
        """Row sums across the quad, then the item's rows out.  ``shift``/``gmask`` map MMA
        row r to (token ``r >> shift``, q head ``head_base + (r & gmask)``)."""
        for slot in cutlass.range_constexpr(2):
            row_sum[slot] = cute.arch.warp_reduction_sum(row_sum[slot], threads_in_group=4)
        row0 = tOcO[0][0]
        poff = mPartialOffsets[it]
        if poff < 0:
            self._store_out(acc_o, tOcO, row_max, row_sum, mO, mSinks2, row0, q_cnt,
                            group_size, mQSL[b] + q_start, head_base, shift, gmask,
                            scale_log2)
        else:
            # packed items: poff + row; unpacked items: chunked rows from poff = base + q
            # head, the item's split index, split count and token count; this warpgroup's
            # first token is tok_u tokens into the item
            poff_w = poff
            tok_u = 0
            if cutlass.const_expr(self.consumers >= 2):
                poff_w = poff + poff_rows
                tok_u = tok_off
            self._store_partial(acc_o, tOcO, row_max, row_sum, mOPartial, mLsePartial, row0,
                                q_cnt, group_size, poff_w, scale_log2, shift, gmask, qh, poff,
                                tok_u, mWork[it, W.SPLIT], mWork[it, W.NSPLIT],
                                mWork[it, W.QLEN])

    @cute.jit
    def _store_out(self, acc_o, tOcO, row_max, row_sum, mO, mSinks2, row0, q_cnt,
                   group_size, tok_base, head_base, shift, gmask, scale_log2):
        """O / l as 16-bit pairs: elements e, e+1 are columns c, c+1 of one row (4-byte
        store).  l includes the q head's attention sink: exp2(sink2 - m * scale_log2) in
        the units of row_sum (-inf: none adds 0; capped at 2^126 so l stays finite)."""
        mO_pairs = cute.recast_tensor(mO, cutlass.Uint32)   # (T, Hq, D/2)
        pair = cute.make_rmem_tensor((2,), self.dtype)
        pair_word = cute.recast_tensor(pair, cutlass.Uint32)
        for slot in cutlass.range_constexpr(2):
            row = row0 + slot * 8
            t_local = row >> shift
            g = row & gmask
            inv = cutlass.Float32(0.0)
            l_row = row_sum[slot]
            if g < group_size:
                m2 = row_max[slot] * scale_log2
                l_row = l_row + cute.math.exp2(
                    cute.arch.fmin(mSinks2[head_base + g] - m2, cutlass.Float32(126.0)),
                    fastmath=True)
            if l_row > 0.0:
                inv = cute.arch.rcp_approx(l_row)
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
    def _store_partial(self, acc_o, tOcO, row_max, row_sum, mOPartial, mLsePartial, row0,
                       q_cnt, group_size, poff, scale_log2, shift, gmask, q_head, poff_item,
                       tok_u, split_idx, n_split, ntok_item):
        """Split-KV partial: O / l (fp32) and lse2 = m * scale_log2 + log2(l).  A packed item
        writes MMA row ``r`` at ``poff + r``; an unpacked item (``q_head >= 0``) writes token
        ``t = tok_u + row`` in chunk ``k = t // c`` (``c = 64 // Gp`` tokens, ``n_k =
        min(c, ntok_item - k * c)``) at ``poff_item + k * n_split * 64 + split_idx * n_k *
        Gp + (t % c) * Gp``: each chunk is one combine group of the packed layout."""
        log2_c = 6 - self.log2_gp
        for slot in cutlass.range_constexpr(2):
            row = row0 + slot * 8
            t_local = row >> shift
            g = row & gmask
            if t_local < q_cnt:
                if g < group_size:
                    prow = poff + row
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
                        lse2 = (row_max[slot] * scale_log2
                                + cute.math.log2(row_sum[slot], fastmath=True))
                    if tOcO[0][1] == 0:
                        mLsePartial[prow] = lse2
                    for e in cutlass.range_constexpr(cute.size(acc_o)):
                        if cutlass.const_expr((e // 2) % 2 == slot):
                            mOPartial[prow, tOcO[e][1]] = acc_o[e] * inv
