"""The kernel benchmark's named shapes and its bytes / FLOPs formulas (pure Python)."""

import types

import pytest

from ion_vllm.bench import kernel_suite as ks

ANCHORS = {  # name -> (q_lens, kv_lens) as the README describes them
    "decode-32x8192-h28/4-d128": ((1,) * 32, (8192,) * 32),
    "decode-128x2048-h28/4-d128": ((1,) * 128, (2048,) * 128),
    "decode-8x32768-h28/4-d128": ((1,) * 8, (32768,) * 8),
    "mixed-32x8192+p2048-h28/4-d128": ((1,) * 32 + (2048,), (8192,) * 32 + (2048,)),
    "prefill-1x8192-h28/4-d128": ((8192,), (8192,)),
}


@pytest.mark.parametrize("name", list(ks.SUITES))
def test_every_suite_is_non_empty_unique_and_part_of_full(name):
    cases = ks.suite(name)
    names = [c.name for c in cases]
    assert cases and len(names) == len(set(names))
    assert set(names) <= {c.name for c in ks.suite("full")}


def test_required_suites_exist():
    assert {"smoke", "anchors", "engine", "engine-d64"} <= set(ks.SUITES)


def test_anchor_shapes():
    a = {c.name: c for c in ks.suite("anchors")}
    for name, (q, kv) in ANCHORS.items():
        assert (a[name].q_lens, a[name].kv_lens) == (q, kv)
        assert (a[name].hq, a[name].hkv, a[name].d, a[name].fa_page) == (28, 4, 128, 16)
    skew = a["decode-32xU512-16384s1234-h28/4-d128"]
    assert skew.batch == 32 and all(512 <= k <= 16384 for k in skew.kv_lens)
    assert len(set(skew.kv_lens)) > 16
    assert ks.skewed_kv_lens(8, 1, 100, 7) == ks.skewed_kv_lens(8, 1, 100, 7) \
        != ks.skewed_kv_lens(8, 1, 100, 8)


@pytest.mark.parametrize("suite,shape,twins", [("engine", (28, 4, 128), ("-aligned", "-qkv")),
                                               ("engine-d64", (32, 8, 64), ("-aligned",))])
def test_engine_suites_are_the_seed_steps_with_their_twins(suite, shape, twins):
    cases = ks.suite(suite)
    by = {c.name: c for c in cases}
    base = [c for c in cases if not c.name.endswith(("-aligned", "-qkv"))]
    steps = ks.chunked_prefill_steps(32, 7680, 8192, 32)
    assert [(c.q_lens, c.kv_lens) for c in base] == [steps[i] for i in ks.ENGINE_SEED_STEPS]
    for c in base:
        assert (c.hq, c.hkv, c.d) == shape and c.qkv_layout == "separate"
        # some prefill row continues at a context that is not a page multiple
        assert any(q > 1 and (k - q) % ks.PAGE for q, k in zip(c.q_lens, c.kv_lens))
        a = by[c.name + "-aligned"]
        assert a.q_lens == c.q_lens
        assert all((k - q) % ks.PAGE == 0 for q, k in zip(a.q_lens, a.kv_lens) if q > 1)
        assert all(0 <= k - ka < ks.PAGE for k, ka in zip(c.kv_lens, a.kv_lens))
        if "-qkv" in twins:
            s = by[c.name + "-qkv"]
            assert (s.q_lens, s.kv_lens, s.qkv_layout) == (c.q_lens, c.kv_lens, "fused")
        else:
            assert c.name + "-qkv" not in by


def test_gqa_suite_covers_heads_and_head_dims():
    g = ks.suite("gqa")
    assert {(c.hq, c.hkv) for c in g} == {(32, 8), (28, 4), (64, 8)}
    assert {c.d for c in g} == {64, 128}
    assert all(f"-h{c.hq}/{c.hkv}-d{c.d}" in c.name for c in g)


def test_bytes_and_flops_hand_computed():
    # decode at kv 10 and a chunk of 3 at kv 5; Hq 4, Hkv 2, D 8, bf16
    c = ks.Case("t", (1, 3), (10, 5), hq=4, hkv=2, d=8)
    assert ks.min_bytes(c) == 2 * 15 * 2 * 8 * 2 + 2 * 4 * 4 * 8 * 2
    assert [ks.attended_pairs(*x) for x in ((1, 10), (3, 5), (4, 4))] == [10, 12, 10]
    assert ks.flops(c) == 4 * 8 * 4 * (10 + 12)
    assert ks.flops(ks.prefill(8192)) == 4 * 128 * 28 * (8192 * 8193 // 2)


def test_rotations_exceed_twice_l2():
    l2 = 50 * 1024 * 1024
    for c in ks.suite("full"):
        n = ks.rotations(c, l2)
        assert n >= 2 and n * c.kv_bytes() >= 2 * l2
        assert n == 2 or (n - 1) * c.kv_bytes() < 2 * l2


def test_chunked_prefill_steps_follow_the_scheduler():
    # 4 prompts of 100 tokens, 128-token budget, 3 seats: hand-traced
    assert ks.chunked_prefill_steps(4, 100, 128, 3) == [
        ((100, 28), (100, 28)),            # p1 whole, p2 starts
        ((1, 72, 55), (101, 100, 55)),     # p1 decodes, p2 ends, p3 starts
        ((1, 1, 45), (102, 101, 100)),     # p3 ends; no seat for p4
    ]
    steps = ks.chunked_prefill_steps(32, 7680, 8192, 32)
    assert len(steps) == 31 and all(sum(q) == 8192 for q, _ in steps[:-1])
    assert sum(x for q, _ in steps for x in q if x > 1) == 32 * 7680
    with pytest.raises(ValueError):
        ks.chunked_prefill_steps(0, 10, 10, 1)


@pytest.mark.parametrize("kw", [dict(q_lens=(5,), kv_lens=(4,)), dict(q_lens=(1,), kv_lens=(4,), hq=6),
                                dict(q_lens=(1,), kv_lens=(4,), qkv_layout="packed"),
                                dict(q_lens=(), kv_lens=())])
def test_invalid_cases_are_refused(kw):
    with pytest.raises(ValueError):
        ks.Case("bad", **kw)


def test_select():
    assert [c.name for c in ks.select()] == [c.name for c in ks.suite("smoke")]
    got = ks.select(["smoke"], ["prefill-1x8192-h28/4-d128", "decode-32x8192-h28/4-d128"])
    assert [c.name for c in got] == [c.name for c in ks.suite("smoke")] + [
        "prefill-1x8192-h28/4-d128"]
    with pytest.raises(KeyError, match="did you mean"):
        ks.select(None, ["decode-32x8192"])
    with pytest.raises(KeyError):
        ks.suite("pages")  # retired with the 128-token-page experiment


def test_feature_suite_and_how_each_backend_gets_the_features():
    """The model-coverage A/B cases, and the same features as ION and FA3 take them:
    FA3's window_size=(W - 1, 0) is the reference's window of W tokens."""
    import torch

    from ion_vllm.bench import kernel_runner as kr
    from ion_vllm.bench.kernel_suite import suite

    cases = {c.name: c for c in suite("features")}
    assert cases["decode-32x16384-h28/4-d128-w4096"].window == 4096
    gpt = [c for c in cases.values() if "gptoss" in c.name]
    assert gpt and all((c.hq, c.hkv, c.d, c.window, c.sinks) == (64, 8, 64, 128, True)
                       for c in gpt)
    c = gpt[0]
    fa = kr.fa_features(c, "cpu")
    assert fa["window_size"] == (127, 0) and torch.equal(fa["s_aux"], c.sink_logits())
    ion = kr.ion_features(c, types.SimpleNamespace(sink_log2=lambda s: s * 2), "cpu")
    assert ion["window"] == 128 and torch.equal(ion["sinks_log2"], c.sink_logits() * 2)
    # the head-size-256 A/B: decode 32 x 8192 and prefill 8192, Gemma 2 9B heads
    d256 = {n for n, c in cases.items() if (c.hq, c.hkv, c.d) == (16, 8, 256)}
    assert {"decode-32x8192-h16/8-d256", "prefill-1x8192-h16/8-d256"} <= d256
    plain = suite("anchors")[0]
    assert kr.fa_features(plain, "cpu") == {"window_size": (-1, -1)}
    assert kr.ion_features(plain, None, "cpu") == {}
