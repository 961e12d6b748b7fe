"""The planner's cost model, and the q-tile size of a step (pure numpy).

``CostModel`` rates an item (one q tile over a KV range) in microseconds of one SM; the
planner balances items over the persistent grid with it and decides split-KV and unpacked
tiling by it.  ``choose_tile_m`` picks a step's q-tile rows (64, 128 or 192) from the balance
of its prefill MMA work against its decode streaming.  Derivation: docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import tile_ms_for


@dataclass(frozen=True)
class CostModel:
    """Analytic per-item cost model, in microseconds of one CTA (one SM).

    item(pages, rows, split) = item_overhead_us                      (prologue/epilogue, fixed)
                             + rows * D * q_bytes / bw                (Q tile load)
                             + pages * max(page_mem, page_mma)        (KV main loop, overlapped)
                             + store(rows, split)                     (out or fp32 partial)
      page_mem = 2 * page_size * D * kv_bytes / bw                    (K page + V page)
      page_mma = 4 * max(rows, min_mma_rows) * page_size * D / flops  (QK^T and PV GEMMs)
      store    = rows * D * q_bytes / bw                              (unsplit: writes out)
               | split_item_overhead_us + rows * (D + 1) * partial_bytes / bw   (split)
    combine(groups) = combine_launch_us
                    + sum_g (S_g * rows_g * (D + 1) * partial_bytes + rows_g * D * q_bytes)
                      / (bw * num_ctas)          (separate pass, all CTAs, bandwidth bound)
    where bw is bytes/us per CTA and flops is flop/us per CTA.
    """

    head_dim: int = 128
    kv_bytes: int = 2
    q_bytes: int = 2
    partial_bytes: int = 4
    hbm_gbps_per_cta: float = 4800.0 / 132.0  # H200 HBM3e shared by 132 SMs
    mma_tflops_per_cta: float = 989.0 / 132.0  # H200 dense bf16 wgmma per SM
    min_mma_rows: int = 64  # wgmma M granularity: a tile always computes 64 rows
    item_overhead_us: float = 1.0
    split_item_overhead_us: float = 0.25
    combine_launch_us: float = 3.0
    # Split-KV is only used when it lowers the modeled time by more than this fraction of
    # the no-split time (hysteresis against model error; the combine pass is real work).
    split_min_gain: float = 0.03

    @property
    def bytes_per_us(self) -> float:
        return self.hbm_gbps_per_cta * 1e3

    @property
    def flops_per_us(self) -> float:
        return self.mma_tflops_per_cta * 1e6

    def page_us(self, rows, page_size: int) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.float64)
        d = self.head_dim
        mem = 2.0 * page_size * d * self.kv_bytes / self.bytes_per_us
        mma = 4.0 * np.maximum(rows, self.min_mma_rows) * page_size * d / self.flops_per_us
        return np.maximum(mem, mma)

    def fixed_us(self, rows, split) -> np.ndarray:
        """Per-item cost that does not depend on the number of pages."""
        rows = np.asarray(rows, dtype=np.float64)
        d = self.head_dim
        bw = self.bytes_per_us
        q_load = rows * d * self.q_bytes / bw
        store_out = rows * d * self.q_bytes / bw
        store_part = self.split_item_overhead_us + rows * (d + 1) * self.partial_bytes / bw
        return self.item_overhead_us + q_load + np.where(split, store_part, store_out)

    def item_us(self, pages, rows, page_size: int, split) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.float64)
        return self.fixed_us(rows, split) + pages * self.page_us(rows, page_size)

    def combine_us(self, splits, rows, num_ctas: int) -> float:
        """Modeled wall time of the combine pass for split groups (0 if there is none)."""
        splits = np.asarray(splits, dtype=np.float64)
        if splits.size == 0:
            return 0.0
        rows = np.asarray(rows, dtype=np.float64)
        d = self.head_dim
        nbytes = np.sum(splits * rows * (d + 1) * self.partial_bytes + rows * d * self.q_bytes)
        return float(self.combine_launch_us + nbytes / (self.bytes_per_us * num_ctas))


DEFAULT_COST_MODEL = CostModel()


#: Rows with at least this many new tokens count as prefill work in ``choose_tile_m``; shorter
#: rows (decode, speculative verification) as memory-bound work.  Uniform speculative-decode
#: batches (q_len = 1 + num_spec, well below this) therefore always get 64-row tiles, which
#: is what keeps the choice stable across CUDA-graph capture and replay (docs/contract.md).
PREFILL_ROW_TOKENS = 64
#: H200 copy bandwidth and causal-attention MMA rate; only their ratio matters
_DECODE_BYTES_PER_S = 4.2e12
_PREFILL_FLOP_PER_S = 6.0e14
#: 128- or 192-row tiles when the decode rows' streaming time is at most this fraction of
#: the prefill rows' MMA time: above every fraction where the wider tiles measured faster
#: (up to 0.18, steady-state serving steps) and well below the smallest where they lost
#: (2.55, 32 decodes at 8k beside a 2048-token chunk); docs/planner.md has the numbers.
M128_MAX_DECODE_FRACTION = 0.25
#: 192-row tiles (three consumer warpgroups) instead of 128 when the prefill rows make at
#: least this many 192-token tiles per CTA of the grid: fewer, larger items balance worse,
#: and 2.25 is the lowest count where 192 rows measured faster (docs/planner.md).
M192_MIN_TILES_PER_CTA = 2.25


def choose_tile_m(query_start_loc, seq_lens, *, num_q_heads: int, num_kv_heads: int,
                  head_dim: int, elem_bytes: int = 2, num_ctas: int = 132) -> int:
    """64, 128 or 192: the q-tile rows for one step (pure; from the host copies the planner
    uses).  192 instead of 128 when the prefill rows make at least
    ``M192_MIN_TILES_PER_CTA * num_ctas`` tiles of one q head x 192 tokens and the head
    size has 192-row kernels (not D = 256).

    Decode-like rows (< PREFILL_ROW_TOKENS new tokens) stream their K/V: ``seq_len *
    num_kv_heads * head_dim * 2 * elem_bytes`` bytes.  Prefill rows cost ``4 * num_q_heads
    * head_dim`` FLOPs per (query, visible key) pair, causal within the chunk.  128-row
    tiles pay only when there is prefill work and the decode streaming time is at most
    ``M128_MAX_DECODE_FRACTION`` of the prefill time.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    sl = np.asarray(seq_lens, dtype=np.int64)
    if qsl.size < 1 or sl.size != qsl.size - 1:
        raise ValueError("query_start_loc must have len(seq_lens) + 1 entries")
    q = np.diff(qsl)
    pre = q >= PREFILL_ROW_TOKENS
    if not pre.any():
        return 64
    ctx = (sl - q)[pre]
    qp = q[pre]
    # visible keys summed over a chunk's queries: q * ctx + q * (q + 1) / 2
    pairs = float(np.sum(qp * ctx + qp * (qp + 1) // 2))
    t_pre = 4.0 * num_q_heads * head_dim * pairs / _PREFILL_FLOP_PER_S
    dec = (~pre) & (q > 0)
    t_dec = float(np.sum(sl[dec])) * num_kv_heads * head_dim * 2 * elem_bytes / _DECODE_BYTES_PER_S
    if t_dec > M128_MAX_DECODE_FRACTION * t_pre:
        return 64
    tiles = float(np.sum((qp + 191) // 192)) * num_q_heads
    if tiles >= M192_MIN_TILES_PER_CTA * num_ctas and 192 in tile_ms_for(head_dim):
        return 192
    return 128
