"""GPU (sm_90) tests of two opt-in kernel experiments of the seventeenth session.

The vectorized straddle copy (``IonAttentionSm90(vec_straddle=True)``,
``make_device_plan(..., vec_straddle=True)``, the backend's ``ION_VEC_STRADDLE=1``): the
fused-writeback kernels copy the rows of a fresh tile that reach into the next cache page
16 bytes a lane instead of one element.  Every fresh tile of a prefill chunk whose context
is not a page multiple straddles, so these batches put chunks at contexts with every kind
of remainder (1, 31, 63 tokens past a page, chunks ending inside the straddled rows) beside
decode rows and fresh prompts, on every tile size the backend runs (64, 128, 192 rows;
unpacked prefill tiles, as the backend plans them) and on the page-pair kernels, with
key/value as strided views of a fused qkv buffer.  Checks as
``test_fused_writeback_gpu._run_case``: output against the fp32 reference (NaN-poisoned
first), cache bit-equal to the reference append at every position < seq_len, foreign blocks
untouched.

``skip_idle`` (``IonAttentionSm90(skip_idle=True)``, ``ION_SKIP_IDLE=1``): on the 128- and
192-row kernels a consumer warpgroup whose rows hold no token of an item issues no wgmma
for it; the same checks on the same batches (decode rows and chunk tails are such items).
The D = 64 kernels compile the 16-byte copy spill-free with a 48-register producer
(twentieth session), but plans at D = 64 run it only once ``attention.VEC_STRADDLE_HEAD_DIMS``
holds 64; the D = 64 case here adds it for the test, so it checks those kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_fused_writeback_gpu import _run_case

P = 64

#: (q_len, ctx): chunks at every straddle remainder, a chunk whose valid rows end inside
#: the straddled part of its last tile, decode rows, a fresh prompt, a row with no work
ROWS = [(1, 8000), (700, 1 * P + 1), (1, 3000), (513, 5 * P + 31), (390, 2 * P + 63),
        (70, 3 * P + 40), (1, 130), (300, 0), (0, 77), (1000, 7 * P + 17)]


def _random_chunks(rng) -> tuple[list[int], list[int]]:
    """(q_lens, seq_lens) of 2-9 rows: decode rows (40%) at contexts < 4000, the rest
    chunks of 2-1499 tokens at contexts < 3000 (any straddle remainder)."""
    q_lens, seq_lens = [], []
    for _ in range(int(rng.integers(2, 10))):
        if rng.random() < 0.4:
            ql, ctx = 1, int(rng.integers(0, 4000))
        else:
            ql, ctx = int(rng.integers(2, 1500)), int(rng.integers(0, 3000))
        q_lens.append(ql)
        seq_lens.append(ql + ctx)
    return q_lens, seq_lens


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("d,hq,hkv", [(128, 28, 4), (64, 16, 8)])
def test_vec_straddle_matches_the_reference(tile_m, d, hq, hkv, monkeypatch):
    from cute_kernels import attention

    monkeypatch.setattr(attention, "VEC_STRADDLE_HEAD_DIMS", frozenset({64, 128}))
    q_lens = [q for q, _ in ROWS]
    seq_lens = [q + c for q, c in ROWS]
    plan = _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, seed=tile_m + d, pad_rows=5,
                     strided=True, plan_kw=dict(vec_straddle=True, tile_m=tile_m,
                                                unpacked_prefill=True))
    assert plan.vec_straddle  # the 16-byte kernels ran, at D = 64 too


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_vec_straddle_random_chunks(seed):
    q_lens, seq_lens = _random_chunks(np.random.default_rng(100 + seed))
    hq, hkv = [(28, 4), (32, 8), (8, 8), (16, 4)][seed]
    _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=128, seed=seed, pad_rows=int(seed),
              force_split=seed % 2 == 0, strided=bool(seed % 2),
              plan_kw=dict(vec_straddle=True, tile_m=(64, 128, 192, 128)[seed],
                           unpacked_prefill=True))


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_vec_straddle_random_chunks_d64(seed, monkeypatch):
    """The D = 64 16-byte kernels (48-register producer) on random chunks, split-KV forced
    on every other case, every tile size."""
    from cute_kernels import attention

    monkeypatch.setattr(attention, "VEC_STRADDLE_HEAD_DIMS", frozenset({64, 128}))
    q_lens, seq_lens = _random_chunks(np.random.default_rng(200 + seed))
    hq, hkv = [(16, 8), (32, 4), (8, 8)][seed]
    plan = _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=64, seed=50 + seed,
                     pad_rows=int(seed), force_split=seed % 2 == 0, strided=bool(seed % 2),
                     plan_kw=dict(vec_straddle=True, tile_m=(64, 128, 192)[seed],
                                  unpacked_prefill=True))
    assert plan.vec_straddle


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv", [(128, 28, 4), (64, 32, 4)])
def test_vec_straddle_on_page_pairs(d, hq, hkv, monkeypatch):
    # the page-pair kernels store a fresh tile from half a stage (_store_fresh_half)
    from cute_kernels import attention

    monkeypatch.setattr(attention, "VEC_STRADDLE_HEAD_DIMS", frozenset({64, 128}))
    q_lens = [q for q, _ in ROWS]
    seq_lens = [q + c for q, c in ROWS]
    plan = _run_case(q_lens, seq_lens, hq=hq, hkv=hkv, d=d, seed=7, strided=True,
                     plan_kw=dict(vec_straddle=True, tile_m=128, unpacked_prefill=True,
                                  kv_pair=True))
    assert plan.vec_straddle


@pytest.mark.gpu
@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("force_split", [False, True])
def test_skip_idle_with_decode_rows_and_chunk_tails(tile_m, force_split):
    """``skip_idle=True`` (``ION_SKIP_IDLE=1``): on 128/192-row tiles the warpgroups that
    hold no token of a decode row's tile or of a chunk's tail tile issue no MMA; every row
    that has work must still match the reference (and rows without work stay poisoned),
    with and without the vectorized straddle copy, split-KV forced or not."""
    for vs in (False, True):
        q_lens = [q for q, _ in ROWS]
        seq_lens = [q + c for q, c in ROWS]
        _run_case(q_lens, seq_lens, hq=28, hkv=4, d=128, seed=tile_m + 3 * vs, pad_rows=2,
                  force_split=force_split, strided=True,
                  plan_kw=dict(skip_idle=True, vec_straddle=vs, tile_m=tile_m,
                               unpacked_prefill=True))
