"""Producer warp of the IonAttention kernel: TMA loads of Q, K and V, and the eager
writeback of the step's new K/V into the paged cache (``fresh_kv``).

Writeback.  The one item owning fresh tile k (``planner.fresh_tile_owned``: its q tile holds
new token ``min(k*P + P-1, q_len-1)``; of the G unpacked items holding it, q head 0) waits on
the stage's full barrier and TMA-stores the K and V tiles from shared memory into page
``pos // P`` at row offset ``pos % P`` (``pos = ctx + k*P``; rows past the page are clipped
by the TMA bounds).  Valid rows that reach into the next page are copied by the producer
warp with 16-byte stores (``_straddle``): a TMA store there would need a negative row
coordinate, which the hardware rejects.  Only prefill chunks whose context is not
page-aligned straddle.  A stage is refilled only after the store issued from it
``kv_stages`` units earlier has finished reading shared memory, and every store has
finished before the CTA exits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from . import worklist as W
from .options import WARPGROUP_ROWS

TILE_M = WARPGROUP_ROWS
#: 16-byte chunks a producer lane loads before it stores them in the straddle copy
STRADDLE_BATCH = 4


class Sm90Producer:
    """Mixin of ``IonAttentionSm90``: uses its ``head_dim``, ``page``, ``group_pad``,
    ``consumers``, ``kv_stages``, ``q_bufs`` and ``fresh_kv``."""

    @cute.jit
    def load(self, tma_q, mQ_tma, tma_qu, mQu_tma, tma_k, mK_tma, tma_v, mV_tma, mQSL,
             mSeqLens, mBlockTable, mWork, group_size, sQ, sK, sV, q_smem_box, q_smem_box_u,
             q_prod, k_prod, v_prod, item_begin, item_end, tidx, tma_kf, mKf_tma, tma_vf,
             mVf_tma, tma_ks, mKs_tma, tma_vs, mVs_tma, mKc, mVc):
        """Warp 0 of the producer warpgroup: per item its Q tile, then its K/V range."""
        D = self.head_dim
        P = self.page
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_k)
        cpasync.prefetch_descriptor(tma_v)
        cpasync.prefetch_descriptor(tma_qu)
        if cutlass.const_expr(self.fresh_kv):
            cpasync.prefetch_descriptor(tma_kf)
            cpasync.prefetch_descriptor(tma_vf)
            cpasync.prefetch_descriptor(tma_ks)
            cpasync.prefetch_descriptor(tma_vs)
        # (Gp, TPT, D, buffers) and (1, TILE_M, D, buffers) views of the Q buffers
        sQ_box = self._q_box_view(sQ, q_smem_box)
        sQ_box_u = self._q_box_view(sQ, q_smem_box_u)
        gK = cute.flat_divide(mK_tma, (P, D))        # (P, D, 1, 1, Hkv, NB)
        gV = cute.flat_divide(mV_tma, (D, P))        # (D, P, 1, 1, Hkv, NB)
        tKsK, tKgK = cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
            cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
            cute.group_modes(gV, 0, 2))
        for it in cutlass.range(item_begin, item_end, 1, unroll=1):
            b = mWork[it, W.REQ]
            h = mWork[it, W.HEAD]
            q_start = mWork[it, W.QSTART]
            p0 = mWork[it, W.P0]
            p1 = mWork[it, W.P1]
            tok0 = mQSL[b] + q_start
            if cutlass.const_expr(self.consumers == 1):
                qh = mWork[it, W.QHEAD]
                q_handle = q_prod.acquire_and_advance()
            else:
                q_handle = q_prod.acquire_and_advance()
                qh = mWork[it, W.QHEAD]
            self._load_q(tma_q, mQ_tma, sQ_box, tma_qu, mQu_tma, sQ_box_u, q_handle,
                         h * group_size, tok0, qh)
            # pipeline state advances only where a loop body calls the pipeline's own
            # methods or assigns it: the DSL carries nothing else across iterations
            if cutlass.const_expr(not self.fresh_kv):
                for p in cutlass.range(p0, p1, 1, unroll=1):
                    page = mBlockTable[b, p]
                    k_handle = k_prod.acquire_and_advance()
                    self._copy_page(tma_k, tKgK, tKsK, k_handle, h, page)
                    v_handle = v_prod.acquire_and_advance()
                    self._copy_page(tma_v, tVgV, tVsV, v_handle, h, page)
            else:
                k_prod, v_prod = self._load_units(
                    tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, k_prod, v_prod, mQSL, mSeqLens,
                    mBlockTable, mWork, sK, sV, it, b, h, q_start, p0, p1, qh, tidx, tma_kf,
                    mKf_tma, tma_vf, mVf_tma, tma_ks, mKs_tma, tma_vs, mVs_tma, mKc, mVc)
        if cutlass.const_expr(self.fresh_kv):
            # every writeback store has finished before the CTA (and its smem) exits
            cute.arch.cp_async_bulk_wait_group(0, read=False)

    def _q_box_view(self, sQ, box):
        return cute.make_tensor(
            cute.recast_ptr(sQ.iterator, box.inner),
            cute.append(box.outer, cute.make_layout(self.q_bufs, stride=cute.cosize(box.outer))))

    @cute.jit
    def _load_q(self, tma_q, mQ_tma, sQ_box, tma_qu, mQu_tma, sQ_box_u, q_handle, head0,
                tok0, qh):
        """The item's Q stage: one 64-row box per consumer warpgroup, box ``w`` into buffer
        ``consumers * stage + w``.  Packed (``qh < 0``): (Gp heads, 64 // Gp tokens) at token
        ``tok0 + w * 64 // Gp``; unpacked: (q head ``head0 + qh``, 64 tokens) at token
        ``tok0 + w * 64``."""
        Gp = self.group_pad
        D = self.head_dim
        TPT = TILE_M // Gp
        for w in cutlass.range_constexpr(self.consumers):
            buf = q_handle.index
            if cutlass.const_expr(self.consumers > 1):
                buf = q_handle.index * self.consumers + w
            if qh < 0:
                self._load_q_box(tma_q, mQ_tma, sQ_box, (Gp, TPT, D), head0, tok0 + w * TPT,
                                 buf, q_handle.barrier)
            else:
                self._load_q_box(tma_qu, mQu_tma, sQ_box_u, (1, TILE_M, D), head0 + qh,
                                 tok0 + w * TILE_M, buf, q_handle.barrier)

    @cute.jit
    def _load_q_box(self, tma, mQ_tma, sQ_box, box, head, tok, buf, bar):
        """One Q TMA box (heads, tokens, D) at (head, tok) into Q buffer ``buf``."""
        gQ = cute.local_tile(cute.domain_offset((head, tok, 0), mQ_tma), box, (0, 0, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(sQ_box, 0, 3),
            cute.group_modes(gQ, 0, 3))
        cute.copy(tma, tQgQ, tQsQ[(None, buf)], tma_bar_ptr=bar)

    @cute.jit
    def _copy_page(self, tma, tg, ts, handle, h, page):
        """Cache ``page`` of KV head ``h`` (a K or V box) into the stage ``handle`` holds."""
        cute.copy(tma, tg[(None, 0, 0, h, page)], ts[(None, handle.index)],
                  tma_bar_ptr=handle.barrier)

    @cute.jit
    def _load_units(self, tma_k, tKgK, tKsK, tma_v, tVgV, tVsV, k_prod, v_prod, mQSL,
                    mSeqLens, mBlockTable, mWork, sK, sV, it, b, h, q_start, p0, p1, qh, tidx,
                    tma_kf, mKf_tma, tma_vf, mVf_tma, tma_ks, mKs_tma, tma_vs, mVs_tma, mKc,
                    mVc):
        """Fused writeback: units ``p0 .. p1-1`` of the item.  Old pages come from the
        cache; fresh tile k (unit ``n_old + k``) from the new K/V rows ``qsl[b] + k*P ..``,
        and its owner stores it into the cache.  One bulk-group commit per unit (empty when
        nothing is stored).  Returns the K and V producers, advanced."""
        P = self.page
        D = self.head_dim
        S = self.kv_stages
        q_cnt = mWork[it, W.QLEN]
        tok_base = mQSL[b]
        q_len = mQSL[b + 1] - tok_base
        seq_len = mSeqLens[b]
        ctx = seq_len - q_len
        n_old = (ctx + P - 1) // P
        for u in cutlass.range(p0, p1, 1, unroll=1):
            # the store issued from the stage this unit refills has read its smem
            cute.arch.cp_async_bulk_wait_group(S - 1, read=True)
            if u < n_old:
                page = mBlockTable[b, u]
                k_handle = k_prod.acquire_and_advance()
                self._copy_page(tma_k, tKgK, tKsK, k_handle, h, page)
                v_handle = v_prod.acquire_and_advance()
                self._copy_page(tma_v, tVgV, tVsV, v_handle, h, page)
            else:
                kt = u - n_old
                tok = tok_base + kt * P
                gKf = cute.flat_divide(cute.domain_offset((tok, 0, 0), mKf_tma), (P, D))
                tKsKf, tKgKf = cpasync.tma_partition(
                    tma_kf, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                    cute.group_modes(gKf, 0, 2))
                gVf = cute.flat_divide(cute.domain_offset((0, tok, 0), mVf_tma), (D, P))
                tVsVf, tVgVf = cpasync.tma_partition(
                    tma_vf, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                    cute.group_modes(gVf, 0, 2))
                k_handle = k_prod.acquire_and_advance()
                cute.copy(tma_kf, tKgKf[(None, 0, 0, h)], tKsKf[(None, k_handle.index)],
                          tma_bar_ptr=k_handle.barrier)
                v_handle = v_prod.acquire_and_advance()
                cute.copy(tma_vf, tVgVf[(None, 0, 0, h)], tVsVf[(None, v_handle.index)],
                          tma_bar_ptr=v_handle.barrier)
                # owner: the q tile holding new token min(k*P+P-1, q_len-1); of the G
                # unpacked items holding it, q head 0.  A tile past the step's new tokens
                # exists only in a plan made from host lengths ahead of the device's (async
                # speculative decoding): its keys are masked and it is never stored.
                t_own = cutlass.min(kt * P + P - 1, q_len - 1)
                if qh > 0:
                    t_own = cutlass.Int32(-1)
                if kt * P >= q_len:
                    t_own = cutlass.Int32(-1)
                if t_own >= q_start:
                    if t_own < q_start + q_cnt:
                        self._writeback(tma_ks, mKs_tma, tma_vs, mVs_tma, sK, sV, mKc, mVc,
                                        mBlockTable, k_handle, v_handle, ctx + kt * P,
                                        seq_len, b, h, tidx % 32)
            cute.arch.cp_async_bulk_commit_group()
        return k_prod, v_prod

    @cute.jit
    def _writeback(self, tma_ks, mKs_tma, tma_vs, mVs_tma, sK, sV, mKc, mVc, mBlockTable,
                   k_handle, v_handle, pos, seq_len, b, h, lane):
        """Store the fresh K/V tile in the stages ``k_handle``/``v_handle`` hold (new tokens
        at positions ``pos ..``) into the cache, once each stage's TMA load has landed (a
        wait on the full barrier's phase does not consume it)."""
        P = self.page
        D = self.head_dim
        S = self.kv_stages
        pg = pos // P
        off = pos - pg * P
        # valid rows (positions < seq_len) reach into page pg + 1; never touch a page past
        # the request's last
        two = cutlass.min(pos + P, seq_len) > (pg + 1) * P
        page1 = mBlockTable[b, pg]
        page2 = page1
        if two:
            page2 = mBlockTable[b, pg + 1]
        cute.arch.mbarrier_wait(k_handle.barrier, (k_handle.count // S) % 2)
        n2 = cutlass.min(pos + P, seq_len) - (pg + 1) * P
        self._store_tile(tma_ks, mKs_tma, sK, k_handle.index, (P, D), 0, off, h, page1)
        if two:
            self._straddle(mKc, sK, k_handle.index, P - off, n2, h, page2, lane, False)
        cute.arch.mbarrier_wait(v_handle.barrier, (v_handle.count // S) % 2)
        self._store_tile(tma_vs, mVs_tma, sV, v_handle.index, (D, P), 1, off, h, page1)
        if two:
            self._straddle(mVc, sV, v_handle.index, P - off, n2, h, page2, lane, True)

    @cute.jit
    def _store_tile(self, tma_s, mS_tma, s_tile, stage, box, row_mode: cutlass.Constexpr,
                    off, h, page):
        """TMA-store smem stage ``stage`` (a K or V tile) at row offset ``off >= 0`` (in mode
        ``row_mode`` of the box) of ``page``; tile rows past the page are clipped by the TMA
        bounds.  One elected thread issues it (the bulk-group state is per thread)."""
        o1 = [0, 0, 0, 0]
        o1[row_mode] = off
        g1 = cute.flat_divide(cute.domain_offset(tuple(o1), mS_tma), box)
        ts1, tg1 = cpasync.tma_partition(
            tma_s, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
            cute.group_modes(g1, 0, 2))
        with cute.arch.elect_one():
            cute.copy(tma_s, ts1[(None, stage)], tg1[(None, 0, 0, h, page)])

    @staticmethod
    def _row_d(row, d, d_first: bool):
        """A (row, d) coordinate in a K/V tile's mode order: (row, d) for K's smem and cache
        views, (d, row) for V's (plain Python, resolved while tracing)."""
        return (d, row) if d_first else (row, d)

    @cute.jit
    def _straddle(self, mC, sX, stage, r0, n2, h, page2, lane, d_first: cutlass.Constexpr):
        """Copy fresh-tile rows ``r0 .. r0 + n2 - 1`` of K or V stage ``stage`` (smem ``sX``)
        into rows ``0 .. n2 - 1`` of cache page ``page2`` (``mC``: (row, d, head, page) for
        K, ``d_first`` (d, row, head, page) for V), 16 bytes (8 elements of a row) a lane.
        A lane loads ``STRADDLE_BATCH`` chunks, then stores them, so the shared-memory
        latency is paid once a batch; chunk indices past the end are clamped to the last
        chunk, so those lanes store the same 16 bytes to the same place again."""
        V8 = self.head_dim // 8
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
