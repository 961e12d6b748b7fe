"""scripts/e2e_attention_bound.py: the end-to-end bound of an attention backend, from a
profile and the kernel suite's ceilings (CPU only)."""

from __future__ import annotations

import json
import os

import pytest
from script_loader import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARE = os.path.join(ROOT, "bench/results/2026-12-03-h200/session17/share-reuse/share/"
                     "attention_share.json")
KERNEL = os.path.join(ROOT, "bench/results/2026-12-03-h200/session19/suites/anchors/"
                      "summary.json")

bound = load_script("e2e_attention_bound.py", "e2e_attention_bound")


def _share(total, attn, short, long_, workload):
    res = {"total_us": total, "category_us": {"attention": attn},
           "attention_calls": {"short": {"us": short}, "long": {"us": long_}}}
    return {"meta": {"baseline": "B", "workload": workload}, "results": {"B": res}}


def _summary(copy_gbps, gemm_tflops, records):
    return {"ceilings": {"copy_gbps": copy_gbps, "gemm_tflops": gemm_tflops},
            "records": records}


def test_attention_work_counts_causal_flops_and_decode_reads():
    w = {"profile_prompts": 2, "input_len": 1000, "output_len": 11}
    flops, dbytes = bound.attention_work(w, layers=3, q_heads=8, kv_heads=2, head_dim=64)
    assert flops == 3 * 2 * 2.0 * 1000 * 1000 * 64 * 8
    # 10 decode steps, 2 sequences at a mean 1005.5 tokens, K and V of 2 heads, bf16
    assert dbytes == pytest.approx(3 * 10 * 2 * 1005.5 * 2 * 2 * 64 * 2)


def test_bound_by_hand():
    """T = 1000 us, attention 400 (decode 200, prefill 150, rest 50). Work chosen so the
    decode floor is 100 us and prefill at the GEMM ceiling 50 us: the bound is
    1000 / (600 + 100 + 50) at 100%, and the needed fraction solves 1000/1.2 = 700 + 50/e."""
    w = {"profile_prompts": 1, "input_len": 1000, "output_len": 2}
    flops, dbytes = bound.attention_work(w, 1, 1, 1, 1)
    G = flops / 50e-6 / 1e12  # TFLOP/s that make the prefill floor 50 us
    C = dbytes / 100e-6 / 1e9
    share = _share(1000.0, 400.0, 200.0, 150.0, w)
    rec = {"backend": "x", "case": "p", "flops": flops, "median_us": 100.0}  # 0.5 of G
    r = bound.analyse(share, _summary(C, G, [rec]), layers=1, q_heads=1, kv_heads=1,
                      head_dim=1, bar=1.2, prefill_case="p")
    assert r["bound_at_gemm_ceiling"] == pytest.approx(1000 / 750)
    assert r["best_prefill"]["gemm_fraction"] == pytest.approx(0.5)
    assert r["best_prefill"]["bound"] == pytest.approx(1000 / 800)
    assert r["prefill_gemm_fraction_needed"] == pytest.approx(50 / (1000 / 1.2 - 700))
    assert r["measured"]["B"]["decode_copy_fraction"] == pytest.approx(0.5)
    assert r["measured"]["B"]["prefill_gemm_fraction"] == pytest.approx(50 / 150)
    # a measured decode faster than the floor is what the bound uses
    share2 = _share(1000.0, 400.0, 80.0, 150.0, w)
    r2 = bound.analyse(share2, _summary(C, G, [rec]), layers=1, q_heads=1, kv_heads=1,
                       head_dim=1, bar=1.2, prefill_case="p")
    assert r2["decode_used_ms"] == pytest.approx(0.080)
    with pytest.raises(KeyError, match="no record"):
        bound.analyse(share, _summary(C, G, [rec]), layers=1, q_heads=1, kv_heads=1,
                      head_dim=1, bar=1.2, prefill_case="missing")


def test_recorded_seed_profile_needs_more_than_any_measured_prefill(tmp_path):
    """On the recorded seed profile and the nineteenth session's kernel suite, the 1.05 bar
    needs prefill attention far above the best fraction of the GEMM ceiling any backend
    reached on a lone 8192 causal prefill (the report the notes cite)."""
    out = tmp_path / "b"
    assert bound.main(["--share", SHARE, "--kernel", KERNEL, "--out", str(out)]) == 0
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["baseline"] == "FLASH_ATTN" and 0.25 < r["attention_share"] < 0.30
    assert r["best_prefill"]["gemm_fraction"] < 0.8
    assert r["prefill_gemm_fraction_needed"] > r["best_prefill"]["gemm_fraction"] + 0.1
    assert r["best_prefill"]["bound"] < 1.05
    assert "needs prefill attention" in (tmp_path / "b.md").read_text()


def test_attention_work_uses_the_recorded_lengths():
    """A profile of skewed lengths (attention_share.py --range-ratio) records them; the work
    is then summed request by request."""
    w = {"profile_prompts": 2, "input_len": 1000, "output_len": 11,
         "profile_lengths": [[500, 3], [1500, 1]]}
    flops, dbytes = bound.attention_work(w, layers=1, q_heads=1, kv_heads=1, head_dim=1)
    assert flops == 2.0 * (500 * 500 + 1500 * 1500)
    # request 0 decodes twice, reading 501 and 502 tokens; request 1 never decodes
    assert dbytes == pytest.approx((501 + 502) * 2 * 2)
