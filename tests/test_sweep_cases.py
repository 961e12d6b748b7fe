"""CPU tests of scripts/gpu_sweep.py: case generator, judging and the run loop
(with reference-backed / deliberately broken implementations injected)."""

import json
import math
import os
import subprocess
import sys
import types

import pytest
from script_loader import load_script

from cute_kernels.options import tile_ms_for
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "scripts", "gpu_sweep.py")


def _load():
    return load_script("gpu_sweep.py", "gpu_sweep_under_test")


sw = _load()


@pytest.fixture(scope="module")
def default_cases():
    return sw.make_cases(sw.DEFAULT_CASES, 0)


def test_default_count_and_bounds(default_cases):
    assert len(default_cases) == sw.DEFAULT_CASES >= 1000
    for c in default_cases:
        assert c.total_kv <= sw.DEFAULT_MAX_KV_TOKENS
        assert len(c.q_lens) == len(c.seq_lens) >= 2
        for q, L in zip(c.q_lens, c.seq_lens):
            assert 0 <= q <= 2048 and 0 <= L <= 32768
            assert L >= q
            assert not (L == 0 and q > 0)
        assert c.hq == c.g * c.hkv and 1 <= c.hkv <= 4
        assert c.dtype in ("bfloat16", "float16")
        assert c.slot_dtype in ("int64", "int32")
        # every case mixes decode rows with a prefill chunk
        assert 1 in c.q_lens
        assert any(q >= 2 for q in c.q_lens)


def test_coverage(default_cases):
    cs = default_cases
    assert {c.g for c in cs} == {1, 4, 7, 8, 12, 16}
    assert {c.d for c in cs} == {64, 128, 256}
    assert {c.hkv for c in cs} == {1, 2, 3, 4}
    assert {(c.g, c.d, c.dtype) for c in cs} == {
        (g, d, t) for g in (1, 4, 7, 8, 12, 16) for d in (64, 128, 256)
        for t in ("bfloat16", "float16")}
    assert sum(c.dtype == "float16" for c in cs) >= 30
    lens = [L for c in cs for L in c.seq_lens]
    assert 1 in lens
    assert sum(1 for L in lens if L > 0 and L % 64 == 0) >= 50
    assert sum(1 for L in lens if L % 64 == 1) >= 20
    assert sum(1 for L in lens if L % 64 == 63) >= 20
    assert max(lens) >= 30000
    assert sum(1 for L in lens if L >= 16384) >= 20
    rows = [(q, L) for c in cs for q, L in zip(c.q_lens, c.seq_lens)]
    assert sum(1 for q, L in rows if q == 0 and L > 0) >= 50  # 0 new tokens, with context
    assert sum(1 for q, L in rows if q == 0 and L == 0) >= 20  # empty requests
    assert sum(1 for q, L in rows if q >= 2 and q == L) >= 50  # fresh prefills
    assert sum(1 for q, L in rows if q >= 2 and L > q) >= 100  # chunks with context
    assert sum(1 for q, L in rows if q >= 2 and (L - q) % 64 == 0 and L > q) >= 20
    assert max(q for q, _ in rows) >= 1900
    assert sum(1 for c in cs if c.pad_rows > 0) >= 30
    assert {"decode", "prefill", "chunk", "zero_new", "empty", "page_boundary", "long",
            "pad_rows", "softcap", "window", "sinks"} <= {t for c in cs for t in c.tags}
    assert {c.window for c in cs} == {0, *sw.WINDOWS}
    # gpt-oss (sinks + window + d64) and Gemma 2 (soft cap + window) combinations occur
    assert any(c.sinks and c.window and c.d == 64 for c in cs)
    assert any(c.softcap and c.window for c in cs)
    # a quarter soft-capped, on every GQA ratio, head size and path
    capped = [c for c in cs if c.softcap]
    assert 0.18 * len(cs) < len(capped) < 0.32 * len(cs)
    assert all(c.softcap in sw.SOFTCAPS and "softcap" in c.tags for c in capped)
    assert {c.softcap for c in capped} == set(sw.SOFTCAPS)
    assert {(c.g, c.d, sw.case_path(c)[0]) for c in capped} == {
        (g, d, p) for g in sw.GQA_RATIOS for d in sw.HEAD_DIMS for p in sw.PATHS}


def test_deterministic_by_seed():
    a = sw.make_cases(60, 5)
    b = sw.make_cases(60, 5)
    c = sw.make_cases(60, 6)
    assert [x.to_json() for x in a] == [x.to_json() for x in b]
    assert [x.to_json() for x in a] != [x.to_json() for x in c]
    # a case does not depend on how many cases are generated
    assert sw.make_cases(10, 5)[7].to_json() == a[7].to_json()


def test_bounds_options():
    cs = sw.make_cases(40, 1, max_kv_tokens=4096, pad_rows=False)
    assert all(c.total_kv <= 4096 for c in cs)
    assert all(c.pad_rows == 0 for c in cs)


def test_judge():
    """max error <= 2 x PyTorch's + atol, relative L2 <= 1e-2, no NaN in written rows,
    poison and cache kept."""
    assert sw.judge(0.01, 0.006, False, True, True, 0.0)
    assert sw.judge(0.0, 0.0, False, True, True, 0.0)
    assert not sw.judge(0.013, 0.006, False, True, True, 0.0)
    assert not sw.judge(float("nan"), 0.006, False, True, True, 0.0)
    assert not sw.judge(1e-3, 0.006, True, True, True, 0.0)
    assert not sw.judge(1e-3, 0.006, False, False, True, 0.0)
    assert not sw.judge(1e-3, 0.006, False, True, False, 0.0)
    assert sw.judge(1e-3, 0.006, False, True, True, 0.009)
    assert not sw.judge(1e-3, 0.006, False, True, True, 0.011)  # spread thin, yet too far
    assert not sw.judge(1e-3, 0.006, False, True, True, float("nan"))


def test_paths_and_tile_sizes_rotate(default_cases):
    """Every case of a sweep runs one of the backend's layer paths on one tile size, and a
    sweep covers each (path, tile size, head size, GQA ratio) combination."""
    seen = {(sw.case_path(c), c.d, c.g) for c in default_cases}
    assert seen == {((p, t), d, g) for p in sw.PATHS for d in (64, 128, 256)
                    for t in tile_ms_for(d) for g in (1, 4, 7, 8, 12, 16)}


def test_summarize_nan_is_worst(default_cases):
    cs = default_cases[:3]
    res = [{"index": 0, "pass": True, "max_abs_err": 1e-3, "path": "fused", "tile_m": 64},
           {"index": 1, "pass": False, "max_abs_err": float("nan"), "path": "append",
            "tile_m": 128},
           {"index": 2, "pass": False, "max_abs_err": None, "error": "boom", "path": "fused",
            "tile_m": 192}]
    s = sw.summarize(cs, res)
    assert s["failed"] == 2 and s["failed_indices"] == [1, 2] and s["verdict"] == "FAIL"
    assert any(math.isnan(v["max_abs_err"]) for v in s["by_variant"].values()
               if v["max_abs_err"] is not None)
    assert sum(v["errors"] for v in s["by_variant"].values()) == 1


# ---- the run loop on CPU with injected implementations --------------------------

def _ref_impl(**overrides):
    from cute_kernels.reference import reference_kv_append, reference_paged_attention, \
        written_rows_mask

    def ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None, value=None,
                      softcap=0.0, window=0, sinks_log2=None):
        if key is not None:  # fused path: this call writes the new K/V itself
            from cute_kernels.reference import new_token_slot_mapping

            assert plan is not None and plan.fresh_kv
            reference_kv_append(key, value, kc, vc,
                                new_token_slot_mapping(qsl, sl, bt, sw.PAGE, q.shape[0]))
        assert plan is None or plan.window == window, "plan pruned for another window"
        sinks = None if sinks_log2 is None else sinks_log2 * math.log(2.0)
        ref = reference_paged_attention(q, kc, vc, qsl, sl, bt, scale, softcap=softcap,
                                        window=window or None, sinks=sinks)
        m = written_rows_mask(qsl, sl, q.shape[0])
        out[m] = ref[m].to(out.dtype)

    impl = types.SimpleNamespace(kv_append=reference_kv_append, ion_attention=ion_attention)
    for k, v in overrides.items():
        setattr(impl, k, v)
    return impl


SMALL = sw.make_cases(12, 11, max_kv_tokens=1500)


FEATURED = [c for c in sw.make_cases(400, 11, max_kv_tokens=1500)
            if c.window or c.sinks or c.softcap][:6]


@pytest.mark.parametrize("case", SMALL[:6] + FEATURED,
                         ids=lambda c: f"case{c.index}-{'-'.join(t for t in c.tags if t in ('window', 'sinks', 'softcap'))}")
def test_run_case_reference_impl_passes(case):
    r = sw.run_case(case, "cpu", impl=_ref_impl())
    assert r["error"] is None, r.get("traceback")
    assert r["pass"] and r["cache_ok"] and r["poison_ok"] and not r["nan_in_written"]
    assert r["max_abs_err"] <= 2 * r["pytorch_max_abs_err"] + sw.ATOL


def test_run_case_detects_bugs():
    from cute_kernels.reference import reference_kv_append
    case = next(c for c in SMALL if (c.pad_rows > 0 or 0 in c.q_lens)
                and not (c.window or c.sinks or c.softcap))
    base = _ref_impl()

    def attn_touches_all(q, kc, vc, out, qsl, sl, bt, scale, plan=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale)
        out[torch.isnan(out)] = 0  # writes rows it must not touch

    def attn_misses_rows(q, kc, vc, out, qsl, sl, bt, scale, plan=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale)
        out[int(qsl[-1]) - 1] = float("nan")  # last written row missing

    def attn_wrong_scale(q, kc, vc, out, qsl, sl, bt, scale, plan=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale * 2.0)

    def append_off_by_one(key, value, kc, vc, slots):
        s = slots.clone()
        s[s >= 0] += 1
        s[s >= kc.shape[0] * kc.shape[2]] = -1
        reference_kv_append(key, value, kc, vc, s)

    def append_skips_half(key, value, kc, vc, slots):
        s = slots.clone()
        s[::2] = -1
        reference_kv_append(key, value, kc, vc, s)

    def crashes(*a, **k):
        raise RuntimeError("kernel exploded")

    checks = [
        (dict(ion_attention=attn_touches_all), "poison_ok"),
        (dict(ion_attention=attn_misses_rows), "nan_in_written"),
        (dict(ion_attention=attn_wrong_scale), "rel_err"),
        (dict(kv_append=append_off_by_one), "cache_ok"),
        (dict(kv_append=append_skips_half), "cache_ok"),
        (dict(ion_attention=crashes), "error"),
    ]
    for ov, field in checks:
        r = sw.run_case(case, "cpu", impl=_ref_impl(**ov), path="append")
        assert not r["pass"], (list(ov), field, r)
        if field == "poison_ok":
            assert r["poison_ok"] is False
        elif field == "nan_in_written":
            assert r["nan_in_written"] is True
        elif field == "rel_err":
            assert r["max_abs_err"] > 2 * r["pytorch_max_abs_err"] + sw.ATOL
        elif field == "cache_ok":
            assert r["cache_ok"] is False
        else:
            assert "kernel exploded" in r["error"]


def test_fused_path_and_forced_splits_on_cpu():
    """--path fused with the reference stand-in passes; forced splits really split; the
    fused cache check ignores slots past seq_len in a request's last page but catches a
    missing write and a write into a block no request uses."""
    from cute_kernels.reference import reference_kv_append

    base = _ref_impl()
    long_case = next(c for c in sw.make_cases(40, 3, max_kv_tokens=6000)
                     if max(c.seq_lens) >= 700 and 0 < min(q for q in c.q_lens if q) < 4)
    r = sw.run_case(long_case, "cpu", impl=base, path="fused", force_split=True)
    assert r["error"] is None, r.get("traceback")
    assert r["pass"] and r["cache_ok"] and r["path"] == "fused"
    assert r["split_items"] > 0 and r["partial_rows"] > 0
    r = sw.run_case(long_case, "cpu", impl=base, path="append", force_split=False)
    assert r["pass"] and r["forced_split"] is False

    def garbage_past_seq_len(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None,
                             value=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=plan, key=key,
                           value=value)
        for b, L in enumerate(sl.tolist()):
            if L % sw.PAGE:
                kc[int(bt[b, (L - 1) // sw.PAGE]), :, L % sw.PAGE:] = 123.0  # allowed

    def skips_writes(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None, value=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=plan)

    def scribbles_unused_block(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None,
                               value=None):
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=plan, key=key,
                           value=value)
        used = {int(bt[b, i]) for b, L in enumerate(sl.tolist())
                for i in range((L + sw.PAGE - 1) // sw.PAGE)}
        spare = next(i for i in range(kc.shape[0]) if i not in used)
        vc[spare, 0, 0, 0] += 1.0

    def skip_plain(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None, value=None):
        del key, value  # attention on the old cache: the new tokens' K/V are missing
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=None)

    ok = sw.run_case(long_case, "cpu", path="fused",
                     impl=_ref_impl(ion_attention=garbage_past_seq_len))
    assert ok["pass"], ok
    for bad in (skips_writes, scribbles_unused_block, skip_plain):
        r = sw.run_case(long_case, "cpu", path="fused", impl=_ref_impl(ion_attention=bad))
        assert not r["pass"], bad.__name__
        assert r["cache_ok"] is False or r["rel_err"] > 1e-2, (bad.__name__, r)
    del reference_kv_append


def test_unpacked_plans_in_the_sweep_on_cpu():
    """G = 7 prefill chunks get unpacked items (recorded per case), and the reference
    stand-in passes with both paths."""
    cases = [c for c in sw.make_cases(60, 5, max_kv_tokens=4000) if c.g == 7
             and any(q >= 256 for q in c.q_lens)]
    assert cases, "the generator should produce G=7 cases with long prefill chunks"
    for path in ("append", "fused"):
        r = sw.run_case(cases[0], "cpu", impl=_ref_impl(), path=path)
        assert r["error"] is None, r.get("traceback")
        assert r["pass"] and r["unpacked_items"] > 0


@pytest.mark.parametrize("tile_m", sw.TILE_MS)
def test_tile_sizes_in_the_sweep_on_cpu(tile_m):
    """Plans of 64/128/192-row tiles, recorded per case."""
    case = SMALL[0]
    for path in ("append", "fused"):
        r = sw.run_case(case, "cpu", impl=_ref_impl(), path=path, tile_m=tile_m,
                        force_split=True)
        assert r["error"] is None, r.get("traceback")
        assert r["pass"] and r["tile_m"] == tile_m


def test_fault_injection_fails_every_case():
    for case in SMALL[:6]:
        r = sw.run_case(case, "cpu", fault="spare_pages", impl=_ref_impl())
        assert r["error"] is None, r.get("traceback")
        # the fused stand-in writes the new K/V through the broken table too, so a fresh
        # prompt can attend right while its cache is wrong
        assert not r["pass"] and (r["rel_err"] > 5e-2 or not r["cache_ok"]), (case.to_json(), r)


def test_cli_list_and_help():
    r = subprocess.run([sys.executable, PATH, "--list", "--cases", "5", "--seed", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["index"] for x in lines] == list(range(5))
    assert lines[3] == {**sw.make_case(3, 2).to_json(), "path": list(sw.case_path(sw.make_case(3, 2)))}
    h = subprocess.run([sys.executable, PATH, "--help"], capture_output=True, text=True,
                       timeout=120)
    assert h.returncode == 0 and "--cases" in h.stdout and "--fault" in h.stdout


@pytest.mark.parametrize("feature", ["window", "sinks", "softcap"])
def test_a_kernel_that_ignores_a_feature_fails_its_cases(feature):
    """The featured cases really test the feature: an implementation that drops it fails."""
    def bites(c):  # the feature changes this case's answer
        if feature == "window":
            return 0 < c.window < max(c.seq_lens) - 1
        return c.softcap < 10 if feature == "softcap" else True

    cases = [c for c in sw.make_cases(600, 13, max_kv_tokens=1500)
             if getattr(c, feature) and bites(c) and sum(c.seq_lens) > 300][:3]
    assert cases
    base = _ref_impl()

    def drops(q, kc, vc, out, qsl, sl, bt, scale, plan=None, key=None, value=None, **kw):
        kw.pop({"window": "window", "sinks": "sinks_log2", "softcap": "softcap"}[feature])
        if feature == "window":
            plan.window = 0  # the plan check would catch it first: test the output
        base.ion_attention(q, kc, vc, out, qsl, sl, bt, scale, plan=plan, key=key,
                           value=value, **kw)

    results = [sw.run_case(c, "cpu", impl=_ref_impl(ion_attention=drops), path="append")
               for c in cases]
    assert not any(r["pass"] for r in results), [r.get("error") for r in results]
