"""CPU tests of cute_kernels.reference (the fp32 reference every kernel test compares
against, and its PyTorch-in-bf16/fp16 yardstick) against a naive dense implementation."""

import math

import pytest
import torch

from cute_kernels.reference import (
    FP8_KV_DTYPE,
    FP8_MAX,
    dequantize_kv,
    make_paged_case,
    new_token_slot_mapping,
    quantize_kv,
    reference_kv_append,
    reference_paged_attention,
    relative_error,
    written_rows_mask,
)
from plan_checks import seeded  # noqa: F401  (a fixture)

PAGE = 64


def naive_attention(q, k_cache, v_cache, qsl, seq_lens, block_table, scale, window=None,
                    softcap=None, sinks=None):
    """Dense float64 attention: gather key by key through the block table, explicit tril
    (and band) mask, one q head at a time; the sink as an explicit extra denominator term."""
    total_q, hq, d = q.shape
    _, hkv, page, _ = k_cache.shape
    g = hq // hkv
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    qsl = qsl.tolist()
    for b, L in enumerate(seq_lens.tolist()):
        s, e = qsl[b], qsl[b + 1]
        ql = e - s
        if ql == 0 or L == 0:
            continue
        pos = torch.arange(L)
        blk = block_table[b, pos // page].long()  # the page of every key position
        k = k_cache[blk, :, pos % page].double()  # [L, Hkv, D]
        v = v_cache[blk, :, pos % page].double()
        k = k.repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(g, dim=1)
        full_mask = torch.tril(torch.ones(L, L, dtype=torch.bool))
        if window is not None:
            full_mask &= torch.triu(torch.ones(L, L, dtype=torch.bool), -(window - 1))
        mask = full_mask[L - ql:]  # rows of the new tokens
        for h in range(hq):
            sc = (q[s:e, h].double() @ k[:, h].T) * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            sc = sc.masked_fill(~mask, float("-inf"))
            m = sc.max(dim=-1, keepdim=True).values
            if sinks is not None:
                m = torch.maximum(m, torch.tensor(float(sinks[h]), dtype=torch.float64))
            w = torch.exp(sc - m)
            den = w.sum(dim=-1, keepdim=True)
            if sinks is not None:
                den = den + torch.exp(float(sinks[h]) - m)
            out[s:e, h] = (w / den) @ v[:, h]
    return out


CASES = [
    # (q_lens, seq_lens, Hq, Hkv, D)
    ([1], [1], 1, 1, 64),
    ([1, 1, 1], [64, 65, 63], 4, 1, 128),               # page boundaries, decode
    ([5], [5], 8, 1, 64),                               # fresh prefill, G=8
    ([64, 1], [128, 129], 7, 1, 128),                   # G=7
    ([0, 3, 0, 1], [50, 70, 0, 200], 8, 2, 64),         # 0-new rows, seq_len 0
    ([130], [300], 28, 4, 128),                         # Qwen-7B shape, long chunk
    ([1, 200, 1, 0], [1000, 256, 1, 17], 16, 2, 128),   # mixed
    ([65, 63], [65, 127], 4, 4, 64),                    # G=1
    ([2, 3], [191, 192], 14, 2, 64),                    # G=7, Hkv=2
]


@pytest.mark.parametrize("idx", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_matches_naive(idx, dtype):
    q_lens, seq_lens, hq, hkv, d = CASES[idx]
    case = make_paged_case(1000 + idx, q_lens, seq_lens, hq, hkv, d, PAGE, dtype)
    q, kc, vc, qsl, sl, bt = case
    scale = 1.0 / math.sqrt(d)
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale)
    assert ref.dtype == torch.float32 and ref.shape == q.shape
    naive = naive_attention(q, kc, vc, qsl, sl, bt, scale)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref.double(), naive, atol=2e-5, rtol=2e-5)


FEATURES = [
    # (window, softcap, sinks): each alone and as gpt-oss / Gemma 2 combine them
    (1, None, False), (17, None, False), (64, None, False), (65, None, False),
    (300, None, False), (None, 30.0, False), (None, None, True), (128, None, True),
    (100, 50.0, False), (5, 2.0, True),
]


@pytest.mark.parametrize("window,softcap,sinks", FEATURES,
                         ids=[f"w{w}-cap{c}-sinks{s}" for w, c, s in FEATURES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_window_softcap_and_sinks_match_naive(window, softcap, sinks, dtype, seeded):
    """Windows below, at and above a page; the soft cap; sinks: the reference against the
    float64 dense formulas (band mask, cap on scaled scores, sink in the denominator)."""
    rng = seeded.rng()
    q_lens, seq_lens = [1, 70, 0, 3, 129, 2], [1, 200, 40, 64, 129, 420]
    hq, hkv, d = 8, 2, 64
    q, kc, vc, qsl, sl, bt = make_paged_case(int(rng.integers(1 << 30)), q_lens, seq_lens,
                                             hq, hkv, d, PAGE, dtype)
    sink = torch.tensor(rng.normal(0.0, 2.0, hq), dtype=torch.float32) if sinks else None
    scale = 0.125
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale, window=window,
                                    softcap=softcap, sinks=sink)
    naive = naive_attention(q, kc, vc, qsl, sl, bt, scale, window=window, softcap=softcap,
                            sinks=sink)
    torch.testing.assert_close(ref.double(), naive, atol=2e-5, rtol=2e-5)
    plain = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale)
    assert not torch.allclose(ref, plain)  # each feature changes the answer here


def test_features_refuse_bad_values_and_window_of_the_whole_sequence_is_plain():
    q, kc, vc, qsl, sl, bt = make_paged_case(3, [4, 1], [4, 90], 4, 2, 64, PAGE,
                                             torch.bfloat16)
    args = (q, kc, vc, qsl, sl, bt, 0.125)
    assert torch.equal(reference_paged_attention(*args, window=90),
                       reference_paged_attention(*args))
    # a sink of -inf weighs nothing; a soft cap of 0 means none
    assert torch.allclose(reference_paged_attention(*args, sinks=torch.full((4,), -1e30)),
                          reference_paged_attention(*args))
    assert torch.equal(reference_paged_attention(*args, softcap=0.0),
                       reference_paged_attention(*args))
    with pytest.raises(ValueError, match="window"):
        reference_paged_attention(*args, window=0)
    with pytest.raises(ValueError, match="sinks"):
        reference_paged_attention(*args, sinks=torch.zeros(2))


def test_reference_random_many(seeded):
    rng = seeded.rng()
    for i in range(15):
        hkv = int(rng.integers(1, 5))
        g = int(rng.choice([1, 4, 7, 8, 16]))
        d = int(rng.choice([64, 128]))
        q_lens, seq_lens = [], []
        for _ in range(int(rng.integers(1, 6))):
            kind = rng.random()
            if kind < 0.15:
                q_lens.append(0)
                seq_lens.append(int(rng.choice([0, int(rng.integers(1, 301))])))
                continue
            L = int(rng.choice([int(rng.integers(1, 401)),
                                PAGE * int(rng.integers(1, 6)) + int(rng.choice([-1, 0, 1]))]))
            q_lens.append(1 if kind < 0.6 else int(rng.integers(1, min(L, 160) + 1)))
            seq_lens.append(L)
        q, kc, vc, qsl, sl, bt = make_paged_case(int(rng.integers(1 << 30)), q_lens, seq_lens,
                                                 g * hkv, hkv, d, PAGE, torch.bfloat16,
                                                 pad_rows=int(rng.integers(0, 4)))
        scale = float(rng.uniform(0.05, 0.2))
        ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale)
        naive = naive_attention(q, kc, vc, qsl, sl, bt, scale)
        with seeded.case(i=i, q_lens=q_lens, seq_lens=seq_lens, hkv=hkv, g=g, d=d):
            assert relative_error(ref, naive) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_dtype_is_plain_pytorch_in_that_dtype(dtype):
    """``compute_dtype=q.dtype``: the same attention computed as PyTorch does in bf16/fp16
    (products in it, softmax in fp32 rounded back): its outputs are values of that dtype,
    close to the fp32 result but not equal to it (the yardstick of a kernel's error)."""
    q, kc, vc, qsl, sl, bt = make_paged_case(21, [70, 1, 0, 3], [200, 129, 9, 3], 8, 2, 64,
                                             PAGE, dtype, pad_rows=2)
    fp32 = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert torch.equal(fp32, reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125,
                                                       compute_dtype=torch.float32))
    low = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125, compute_dtype=dtype)
    assert low.dtype == torch.float32 and low.shape == q.shape
    assert torch.equal(low, low.to(dtype).float()), "outputs are values of the dtype"
    mask = written_rows_mask(qsl, sl, q.shape[0])
    assert (low[~mask] == 0).all()
    err = relative_error(low, fp32, mask)
    assert 0 < err < 2e-2, err
    naive = naive_attention(q, kc, vc, qsl, sl, bt, 0.125).float()
    assert relative_error(low, naive, mask) < 2e-2


def test_long_chunk_is_chunked_correctly(monkeypatch):
    # Force the score-chunking path (many q chunks) and compare with unchunked.
    import cute_kernels.reference as r
    q, kc, vc, qsl, sl, bt = make_paged_case(3, [300, 1], [700, 90], 8, 2, 64, PAGE)
    full = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    monkeypatch.setattr(r, "_MAX_SCORE_ELEMS", 8 * 700 * 7)  # 7 rows per chunk
    chunked = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    assert torch.equal(full, chunked)


def test_decode_row_equals_last_prefill_row():
    # The last token of a prefill and a decode of the same token see the same KV.
    q, kc, vc, qsl, sl, bt = make_paged_case(5, [40], [100], 4, 1, 128, PAGE)
    full = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.1)
    dec = reference_paged_attention(q[-1:], kc, vc, torch.tensor([0, 1], dtype=torch.int32),
                                    sl, bt, 0.1)
    torch.testing.assert_close(full[-1:], dec, atol=1e-6, rtol=1e-6)


def test_zero_rows_and_padding_untouched():
    q, kc, vc, qsl, sl, bt = make_paged_case(6, [2, 0, 3, 0], [10, 33, 3, 0], 4, 2, 64, PAGE,
                                             pad_rows=4)
    assert q.shape[0] == 9
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    mask = written_rows_mask(qsl, sl, q.shape[0])
    assert mask.tolist() == [True] * 5 + [False] * 4
    assert (ref[~mask] == 0).all()
    assert (ref[mask].abs().sum(dim=(1, 2)) > 0).all()


def test_permuted_block_table_detected():
    # A wrong page mapping must produce a large error (the reference is sensitive).
    q, kc, vc, qsl, sl, bt = make_paged_case(8, [1, 1, 64], [300, 129, 200], 8, 2, 128, PAGE)
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, 1 / math.sqrt(128))
    # Swapping two *fully visible* pages is invisible to attention (a set
    # operation over (k, v) pairs), so swap pages whose visibility differs:
    # page 0 with the partial last page (300 = 4 * 64 + 44) of the decode row ...
    bad = bt.clone()
    bad[0, [0, 4]] = bad[0, [4, 0]]
    wrong = reference_paged_attention(q, kc, vc, qsl, sl, bad, 1 / math.sqrt(128))
    assert relative_error(wrong[0:1], ref[0:1]) > 0.05
    # ... and two pages of the prefill chunk, one of them under the causal edge.
    bad = bt.clone()
    bad[2, [0, 2]] = bad[2, [2, 0]]
    wrong = reference_paged_attention(q, kc, vc, qsl, sl, bad, 1 / math.sqrt(128))
    assert relative_error(wrong[2:], ref[2:]) > 0.05
    # Sanity: swapping two fully visible pages of a decode row changes nothing.
    bad = bt.clone()
    bad[0, [0, 1]] = bad[0, [1, 0]]
    same = reference_paged_attention(q, kc, vc, qsl, sl, bad, 1 / math.sqrt(128))
    assert relative_error(same[0:1], ref[0:1]) < 1e-5
    # Reading a spare (never referenced) page instead is also detected.
    used = set(bt[:, :5].flatten().tolist())
    spare = next(p for p in range(kc.shape[0]) if p not in used)
    bad2 = bt.clone()
    bad2[2, 1] = spare
    wrong2 = reference_paged_attention(q, kc, vc, qsl, sl, bad2, 1 / math.sqrt(128))
    assert relative_error(wrong2, ref) > 0.05
    # Off-by-one causal bound (attending one extra future position) is detected.
    q2, kc2, vc2, qsl2, sl2, bt2 = make_paged_case(9, [64], [64], 4, 1, 64, PAGE)
    ref2 = reference_paged_attention(q2, kc2, vc2, qsl2, sl2, bt2, 0.125)
    shifted = reference_paged_attention(q2[1:], kc2, vc2, torch.tensor([0, 63], dtype=torch.int32),
                                        sl2, bt2, 0.125)
    assert relative_error(shifted, ref2[:63]) > 0.05


def test_gqa_mapping_detected():
    # q head hq must read KV head hq // G, not hq % Hkv.
    q, kc, vc, qsl, sl, bt = make_paged_case(10, [4], [80], 8, 2, 64, PAGE)
    ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    perm = torch.arange(8).reshape(4, 2).T.reshape(-1)  # head order for the wrong mapping
    wrong = reference_paged_attention(q[:, perm], kc, vc, qsl, sl, bt, 0.125)[:, perm.argsort()]
    assert relative_error(wrong, ref) > 0.05


def test_make_paged_case_properties():
    a = make_paged_case(11, [3, 1, 0], [130, 64, 0], 8, 2, 64, PAGE)
    b = make_paged_case(11, [3, 1, 0], [130, 64, 0], 8, 2, 64, PAGE)
    c = make_paged_case(12, [3, 1, 0], [130, 64, 0], 8, 2, 64, PAGE)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a.k_cache, c.k_cache)
    q, kc, vc, qsl, sl, bt = a
    assert q.shape == (4, 8, 64) and q.dtype == torch.bfloat16
    assert kc.shape[1:] == (2, PAGE, 64) and kc.shape == vc.shape
    assert qsl.dtype == torch.int32 and sl.dtype == torch.int32 and bt.dtype == torch.int32
    assert qsl.tolist() == [0, 3, 4, 4]
    used = bt[0, :3].tolist() + bt[1, :1].tolist()
    assert len(set(used)) == 4  # distinct physical pages
    assert kc.shape[0] >= 4 + 4  # spare pages exist
    assert (kc.float().abs().sum(dim=(1, 2, 3)) > 0).all()  # no all-zero pages
    assert (bt >= 0).all() and (bt < kc.shape[0]).all()
    with pytest.raises(ValueError):
        make_paged_case(0, [5], [4], 1, 1, 64, PAGE)


def test_kv_append_and_slot_mapping():
    q, kc, vc, qsl, sl, bt = make_paged_case(13, [3, 0, 65, 1], [66, 10, 65, 128], 4, 2, 64,
                                             PAGE, pad_rows=2)
    total_q = q.shape[0]
    slots = new_token_slot_mapping(qsl, sl, bt, PAGE, total_q)
    assert slots.dtype == torch.int64 and slots.shape == (total_q,)
    assert slots[-2:].tolist() == [-1, -1]
    # request 0: positions 63, 64, 65 -> page 0 offset 63, page 1 offsets 0, 1
    assert slots[:3].tolist() == [int(bt[0, 0]) * 64 + 63, int(bt[0, 1]) * 64, int(bt[0, 1]) * 64 + 1]
    # last request: position 127 -> page 1 offset 63
    assert slots[68].item() == int(bt[3, 1]) * 64 + 63
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(total_q, 2, 64, generator=gen).to(torch.bfloat16)
    val = torch.randn(total_q, 2, 64, generator=gen).to(torch.bfloat16)
    k2, v2 = kc.clone(), vc.clone()
    reference_kv_append(key, val, k2, v2, slots)
    # Naive per-token check.
    k3, v3 = kc.clone(), vc.clone()
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k3[s // 64, :, s % 64] = key[i]
        v3[s // 64, :, s % 64] = val[i]
    assert torch.equal(k2, k3) and torch.equal(v2, v3)
    changed = (k2 != kc).any(dim=(1, 3))  # [blocks, P]
    assert int(changed.sum()) == 69  # exactly the non-padding tokens
    # padding rows' key must not appear anywhere
    assert not torch.equal(k2, kc)
    # After the append, attention of the new tokens sees the new keys.
    ref_old = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125)
    ref_new = reference_paged_attention(q, k2, v2, qsl, sl, bt, 0.125)
    assert relative_error(ref_new, ref_old) > 0.05


def test_kv_append_negative_slots_skipped_and_int32():
    kc = torch.randn(3, 1, 64, 64)
    vc = torch.randn(3, 1, 64, 64)
    key = torch.randn(3, 1, 64)
    val = torch.randn(3, 1, 64)
    k0, v0 = kc.clone(), vc.clone()
    reference_kv_append(key, val, kc, vc, torch.tensor([-1, 130, -5], dtype=torch.int32))
    assert torch.equal(kc[2, 0, 2], key[1, 0]) and torch.equal(vc[2, 0, 2], val[1, 0])
    kc[2, 0, 2] = k0[2, 0, 2]
    vc[2, 0, 2] = v0[2, 0, 2]
    assert torch.equal(kc, k0) and torch.equal(vc, v0)
    with pytest.raises(ValueError):
        reference_kv_append(key, val, kc, vc, torch.tensor([0, 1, 3 * 64]))


def test_relative_error():
    a = torch.ones(4, 2, 2)
    assert relative_error(a, a) == 0.0
    b = a.clone()
    b[0, 0, 0] = 2.0
    assert relative_error(b, a) == pytest.approx(1 / math.sqrt(16))
    b[1, 0, 0] = float("nan")
    assert not relative_error(b, a) <= 1e-2
    mask = torch.tensor([False, False, True, True])
    assert relative_error(b, a, mask) == 0.0


def test_contract_violation_raises():
    q, kc, vc, qsl, sl, bt = make_paged_case(14, [4], [10], 4, 1, 64, PAGE)
    with pytest.raises(ValueError):
        reference_paged_attention(q, kc, vc, qsl, torch.tensor([3], dtype=torch.int32), bt, 0.1)


FP8_SCALES = [(1.0, 1.0), (1 / 128, 1 / 100), (0.0173, 2.0)]


@pytest.mark.parametrize("scales", FP8_SCALES)
def test_fp8_cache_is_attention_over_its_dequantized_values(seeded, scales):
    """An fp8 case equals the fp32 reference over the dequantized cache, bit for bit, and
    the naive float64 attention over it to fp32 rounding."""
    q_lens, seq_lens = [1, 37, 0, 130], [700, 37, 5, 200]
    case = make_paged_case(seeded.value, q_lens, seq_lens, 8, 2, 64, kv_scales=scales)
    q, kc, vc, qsl, sl, bt = case
    assert kc.dtype == vc.dtype == FP8_KV_DTYPE
    ks, vs = scales
    out = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125, k_scale=ks, v_scale=vs)
    kd, vd = dequantize_kv(kc, ks), dequantize_kv(vc, vs)
    assert torch.equal(out, reference_paged_attention(q, kd, vd, qsl, sl, bt, 0.125))
    ref = naive_attention(q, kd, vd, qsl, sl, bt, 0.125)
    assert (out.double() - ref).abs().max().item() < 1e-4
    # the scales matter: the same bytes read with other scales give another answer
    other = reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125, k_scale=2 * ks,
                                      v_scale=vs)
    assert relative_error(other, out) > 1e-2


def test_quantize_kv_rounds_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -1.0, 1.0625, 1.1875, 500.0, -1e9, 2.0 ** -9, 3.3])
    q8 = quantize_kv(x, 1.0)
    assert q8.dtype == FP8_KV_DTYPE
    # 1.0625 is a tie between 1.0 and 1.125: to even (1.0); 1.1875 ties 1.125 / 1.25 -> 1.25
    assert q8.float().tolist() == [0.0, 1.0, -1.0, 1.0, 1.25, FP8_MAX, -FP8_MAX, 2.0 ** -9, 3.25]
    g = torch.Generator().manual_seed(5)
    for scale in (1.0, 1 / 64, 3.7):
        x = torch.randn(4096, generator=g) * 100 * scale
        back = dequantize_kv(quantize_kv(x, scale), scale)
        inside = x.abs() <= FP8_MAX * scale
        tiny = x.abs() < 2.0 ** -6 * scale  # e4m3 subnormals: absolute step 2^-9
        rel = ((back - x).abs() / x.abs())[inside & ~tiny]
        assert rel.max().item() <= 2.0 ** -4 + 1e-7  # half of e4m3's 2^-3 spacing
        assert torch.all(back[~inside].abs() == FP8_MAX * scale)
    with pytest.raises(ValueError, match="> 0"):
        quantize_kv(x, 0.0)


def test_kv_append_quantizes_into_fp8_caches(seeded):
    q_lens, seq_lens = [3, 1], [67, 129]
    _, kc, vc, qsl, sl, bt = make_paged_case(seeded.value, q_lens, seq_lens, 4, 2, 64,
                                              kv_scales=(0.02, 0.05))
    g = torch.Generator().manual_seed(seeded.value)
    key, value = torch.randn(2, 4, 2, 64, generator=g).to(torch.bfloat16)
    slots = new_token_slot_mapping(qsl, sl, bt, PAGE)
    k0, v0 = kc.clone(), vc.clone()
    reference_kv_append(key, value, kc, vc, slots, k_scale=0.02, v_scale=0.05)
    pg, off = slots // PAGE, slots % PAGE
    assert torch.equal(kc[pg, :, off].view(torch.uint8),
                       quantize_kv(key, 0.02).view(torch.uint8))
    assert torch.equal(vc[pg, :, off].view(torch.uint8),
                       quantize_kv(value, 0.05).view(torch.uint8))
    untouched = torch.ones(kc.shape[0], PAGE, dtype=torch.bool)
    untouched[pg, off] = False
    assert torch.equal(kc.permute(0, 2, 1, 3)[untouched].view(torch.uint8),
                       k0.permute(0, 2, 1, 3)[untouched].view(torch.uint8))


def test_scales_need_an_fp8_cache_and_e5m2_is_refused():
    q, kc, vc, qsl, sl, bt = make_paged_case(1, [1], [10], 2, 1, 64)
    with pytest.raises(ValueError, match="fp8 caches only"):
        reference_paged_attention(q, kc, vc, qsl, sl, bt, 0.125, k_scale=0.5)
    e5 = kc.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="e4m3"):
        reference_paged_attention(q, e5, e5, qsl, sl, bt, 0.125)
