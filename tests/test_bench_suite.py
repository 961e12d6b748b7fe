"""Shape-suite generation and the bytes/FLOPs formulas of ion_vllm.bench (CPU only)."""

import math

import pytest

from ion_vllm.bench import kernel_suite as ks


def test_suite_names_unique_and_stable():
    for name in ks.SUITES:
        cases = ks.suite(name)
        names = [c.name for c in cases]
        assert len(names) == len(set(names)), name
        assert cases, name
    full = {c.name for c in ks.suite("full")}
    for name in ("smoke", "anchors", "gqa", "pages"):
        assert {c.name for c in ks.suite(name)} <= full
    assert "decode-32x8192-h28/4-d128" in full


def test_anchor_shapes_as_specified():
    a = {c.name: c for c in ks.suite("anchors")}
    d = a["decode-32x8192-h28/4-d128"]
    assert d.q_lens == (1,) * 32 and d.kv_lens == (8192,) * 32
    assert (d.hq, d.hkv, d.d, d.dtype, d.fa_page, d.ion_page) == (28, 4, 128, "bf16", 16, 64)
    assert a["decode-128x2048-h28/4-d128"].kv_lens == (2048,) * 128
    assert a["decode-8x32768-h28/4-d128"].kv_lens == (32768,) * 8
    m = a["mixed-32x8192+p2048-h28/4-d128"]
    assert m.q_lens == (1,) * 32 + (2048,) and m.kv_lens == (8192,) * 32 + (2048,)
    p = a["prefill-1x8192-h28/4-d128"]
    assert p.q_lens == (8192,) and p.kv_lens == (8192,)
    sk = [c for c in a.values() if c.name.startswith("decode-32xU512-16384")]
    assert len(sk) == 1
    assert sk[0].batch == 32 and all(512 <= k <= 16384 for k in sk[0].kv_lens)
    assert len(set(sk[0].kv_lens)) > 16  # really spread, not constant


def test_gqa_and_page_variants():
    g = ks.suite("gqa")
    heads = {(c.hq, c.hkv) for c in g}
    assert heads == {(32, 8), (28, 4), (64, 8)}
    assert {c.d for c in g} == {64, 128}
    for c in g:
        assert f"-h{c.hq}/{c.hkv}-d{c.d}" in c.name
    pg = ks.suite("pages")
    assert {c.fa_page for c in pg} == {64}
    assert all(c.ion_page == 64 for c in pg)
    assert all(c.name.endswith("-fap64") for c in pg)


def test_skewed_lengths_seeded_and_deterministic():
    a = ks.skewed_kv_lens(32, 512, 16384, seed=7)
    b = ks.skewed_kv_lens(32, 512, 16384, seed=7)
    c = ks.skewed_kv_lens(32, 512, 16384, seed=8)
    assert a == b and a != c
    assert all(512 <= x <= 16384 for x in a)
    assert ks.decode_skewed(seed=7).kv_lens == a
    # the case name carries the seed so a different draw can never alias
    assert ks.decode_skewed(seed=7).name != ks.decode_skewed(seed=8).name


def test_bytes_formula_hand_computed():
    # 2 requests: decode at kv 10, prefill chunk of 3 at kv 5; Hq 4, Hkv 2, D 8, bf16
    c = ks.Case("t", (1, 3), (10, 5), hq=4, hkv=2, d=8)
    kv = 2 * (10 + 5) * 2 * 8 * 2          # K and V, every KV token, Hkv*D*2 bytes
    qo = 2 * (1 + 3) * 4 * 8 * 2           # q read + out written
    assert ks.min_bytes(c) == kv + qo == 960 + 512


def test_flops_formula_causal_hand_computed():
    # decode at kv 10 sees 10 keys; chunk of 3 at kv 5 sees 3, 4, 5 keys
    assert ks.attended_pairs(1, 10) == 10
    assert ks.attended_pairs(3, 5) == 3 + 4 + 5
    assert ks.attended_pairs(4, 4) == 1 + 2 + 3 + 4
    c = ks.Case("t", (1, 3), (10, 5), hq=4, hkv=2, d=8)
    assert ks.flops(c) == 4 * 8 * 4 * (10 + 12)
    p = ks.prefill(8192)
    assert ks.flops(p) == 4 * 128 * 28 * (8192 * 8193 // 2)


def test_rotations_exceed_twice_l2():
    l2 = 50 * 1024 * 1024
    for c in ks.suite("full"):
        n = ks.rotations(c, l2)
        assert n >= 2
        assert n * c.kv_bytes() >= 2 * l2
        assert (n - 1) * c.kv_bytes() < 2 * l2 or n == 2
    small = ks.Case("s", (1,), (64,), hq=4, hkv=1, d=64)
    assert ks.rotations(small, l2) == math.ceil(2 * l2 / small.kv_bytes())


def test_select_and_errors():
    assert [c.name for c in ks.select()] == [c.name for c in ks.suite("smoke")]
    got = ks.select(["smoke"], ["prefill-1x8192-h28/4-d128", "decode-32x8192-h28/4-d128"])
    assert [c.name for c in got] == [c.name for c in ks.suite("smoke")] + [
        "prefill-1x8192-h28/4-d128"]
    with pytest.raises(KeyError):
        ks.select(None, ["nope"])
    with pytest.raises(KeyError):
        ks.suite("nope")
    with pytest.raises(ValueError):
        ks.Case("bad", (5,), (4,))
    with pytest.raises(ValueError):
        ks.Case("bad", (1,), (4,), hq=6, hkv=4)


def test_multi_prefill_cases():
    c = ks.prefills((6656, 7680, 2048), (1024, 0, 0))
    assert c.name == "prefills-6656c1024+7680+2048-h28/4-d128"
    assert c.q_lens == (6656, 7680, 2048) and c.kv_lens == (7680, 7680, 2048)
    assert ks.flops(c) == 4 * 128 * 28 * sum(
        ks.attended_pairs(q, k) for q, k in zip(c.q_lens, c.kv_lens))
    assert [x.name for x in ks.suite("multi")][0] == "prefills-7680+7680+1024-h28/4-d128"
    assert {x.name for x in ks.suite("multi")} <= {x.name for x in ks.suite("full")}
    with pytest.raises(ValueError):
        ks.prefills((10, 20), (0,))


def test_chunked_prefill_steps_follow_the_scheduler():
    # 4 prompts of 100 tokens, 128-token budget, 3 seats: hand-traced
    steps = ks.chunked_prefill_steps(4, 100, 128, 3)
    assert steps == [
        ((100, 28), (100, 28)),            # p1 whole, p2 starts
        ((1, 72, 55), (101, 100, 55)),     # p1 decodes, p2 ends, p3 starts
        ((1, 1, 45), (102, 101, 100)),     # p3 ends; no seat for p4
    ]
    # the seed profile: 32 x 7680 at 8192 a step; every step but the last is full, every
    # prompt is prefilled exactly once, decodes are 1-token rows at prompt + generated
    steps = ks.chunked_prefill_steps(32, 7680, 8192, 32)
    assert len(steps) == 31
    assert all(sum(q) == 8192 for q, _ in steps[:-1]) and sum(steps[-1][0]) < 8192
    assert sum(x for q, _ in steps for x in q if x > 1) == 32 * 7680
    for q, k in steps:
        assert all(x <= y for x, y in zip(q, k))
        ndec = sum(1 for x in q if x == 1)
        assert list(q[:ndec]) == [1] * ndec and all(x > 1 for x in q[ndec:])
        assert all(7680 < y <= 7680 + 30 for y in k[:ndec])
    assert steps[2] == ((1, 1, 6657, 1533), (7682, 7681, 7680, 1533))
    with pytest.raises(ValueError):
        ks.chunked_prefill_steps(0, 10, 10, 1)


def test_engine_d64_suite_is_the_engine_steps_at_head_size_64():
    """Suite engine-d64: suite engine's steps and page-aligned twins at 32 q / 8 KV heads,
    d 64 (the 16-byte straddle copy of the D = 64 kernels against the element-wise one)."""
    eng = {c.name: c for c in ks.suite("engine")}
    cases = ks.suite("engine-d64")
    assert cases and {c.name for c in cases} <= {c.name for c in ks.suite("full")}
    for c in cases:
        assert (c.hq, c.hkv, c.d, c.qkv_layout) == (32, 8, 64, "separate")
        twin = eng[c.name.replace("engine-d64-", "engine-seed-")]
        assert (c.q_lens, c.kv_lens) == (twin.q_lens, twin.kv_lens)
    base = [c for c in cases if not c.name.endswith("-aligned")]
    assert len(base) == len(ks.ENGINE_SEED_STEPS)
    assert all(any(q > 1 and (k - q) % ks.ION_PAGE for q, k in zip(c.q_lens, c.kv_lens))
               for c in base)


def test_engine_suite_pairs_each_step_with_its_aligned_and_strided_twins():
    cases = ks.suite("engine")
    by = {c.name: c for c in cases}
    base = [c for c in cases if not c.name.endswith(("-aligned", "-qkv"))]
    assert len(base) == len(ks.ENGINE_SEED_STEPS)
    for c in base:
        assert c.qkv_layout == "separate"
        # some prefill row continues at a context that is not a page multiple
        assert any(q > 1 and (k - q) % ks.ION_PAGE for q, k in zip(c.q_lens, c.kv_lens))
        a, s = by[c.name + "-aligned"], by[c.name + "-qkv"]
        assert a.q_lens == c.q_lens and a.qkv_layout == "separate"
        assert all((k - q) % ks.ION_PAGE == 0 for q, k in zip(a.q_lens, a.kv_lens) if q > 1)
        assert all(0 <= k - ka < ks.ION_PAGE for k, ka in zip(c.kv_lens, a.kv_lens))
        assert (s.q_lens, s.kv_lens, s.qkv_layout) == (c.q_lens, c.kv_lens, "fused")
        assert s.to_dict()["qkv_layout"] == "fused"
    assert {c.name for c in cases} <= {c.name for c in ks.suite("full")}
    with pytest.raises(ValueError, match="qkv_layout"):
        ks.Case("bad", (1,), (4,), qkv_layout="packed")
