"""summary.json merging, ratios, and table.md / plot.png rendering (CPU)."""

import json

import pytest

from ion_vllm.bench import report


def _k(case, backend, us, status="ok", **kw):
    return {"suite": "kernel", "case": case, "backend": backend, "status": status,
            "median_us": us, "frac_copy_bw": 0.5, "frac_gemm": 0.1, "timing": "interleaved", **kw}


def _e(case, backend, tok, status="ok"):
    runs = [{"repeat": i, "total_tok_s": t, "output_tok_s": t / 10} for i, t in enumerate(tok)]
    return {"suite": "e2e", "case": case, "backend": backend, "status": status, "runs": runs,
            **report.e2e_aggregate(runs)}


def _s(state, backend, ready):
    return {"suite": "startup", "case": state, "backend": backend, "status": "ok",
            "runs": [{"ready_s": x} for x in ready], "median_s": sorted(ready)[len(ready) // 2]}


SUMMARY = {"ceilings": {"copy_gbps": 4000.0, "gemm_tflops": 800.0, "gpu": "NVIDIA H200",
                        "date": "2026-12-07", "versions": {"vllm": "0.26.0"}},
           "records": [_k("decode", "ion", 150.0), _k("decode", "fa3", 180.0),
                       _k("decode", "tag-ion", 160.0),
                       _k("decode", "triton", None, "skipped", error="no triton"),
                       _k("decode", "ion-attn", 120.0, "wrong", rel_err=0.5),
                       _k("prefill", "ion", 1200.0), _k("prefill", "fa3", 1000.0),
                       _e("seed", "ION", [11000.0, 11200.0]),
                       _e("seed", "ION@/t/tag", [10900.0, 11000.0]),
                       _e("seed", "FLASH_ATTN", [10000.0, 10400.0]),
                       _s("warm", "ION", [30.0, 34.0, 32.0]), _s("warm", "FLASH_ATTN", [20.0]),
                       _s("cute-cold", "ION", [90.0])]}


def test_merge_replaces_matching_records_and_keeps_the_rest(tmp_path):
    old = [_k("a", "ion", 1.0), _k("a", "fa3", 2.0), _e("a", "ION", [3.0])]
    report.update_summary(tmp_path, old, {"copy_gbps": 4000.0, "versions": {"torch": "2"}})
    s = report.update_summary(tmp_path, [_k("a", "fa3", 20.0), _k("b", "fa3", 5.0)],
                              {"copy_gbps": None, "gpu": "H200", "versions": {"vllm": "0.26"}})
    assert [(r["suite"], r["case"], r["backend"], r.get("median_us")) for r in s["records"]] == [
        ("kernel", "a", "ion", 1.0), ("kernel", "a", "fa3", 20.0), ("e2e", "a", "ION", None),
        ("kernel", "b", "fa3", 5.0)]
    assert s["ceilings"] == {"copy_gbps": 4000.0, "gpu": "H200",
                             "versions": {"torch": "2", "vllm": "0.26"}}
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    assert report.load_summary(tmp_path / "nowhere") == {"ceilings": {}, "records": []}


def test_e2e_ratio_pairs_runs_by_repeat():
    a = {"total_tok_s": 110.0, "runs": [{"repeat": 1, "total_tok_s": 120.0},
                                         {"repeat": 0, "total_tok_s": 100.0}]}
    b = {"total_tok_s": 100.0, "runs": [{"repeat": 0, "total_tok_s": 100.0},
                                         {"repeat": 1, "total_tok_s": 100.0},
                                         {"repeat": 2, "total_tok_s": 50.0}]}
    r = report.e2e_ratio(a, b)
    assert r["ratio"] == 1.1 and (r["ratio_min"], r["ratio_max"], r["pairs"]) == (1.0, 1.2, 2)
    assert r["ratio_sd"] == pytest.approx(0.1414, abs=1e-4)
    assert report.e2e_ratio(a, {"runs": []}) is None


def test_table_has_every_suite_and_its_ratios():
    t = report.render_table(SUMMARY)
    assert "gpu: NVIDIA H200" in t and "copy ceiling: 4000 GB/s" in t
    row = next(x for x in t.splitlines() if x.startswith("| decode |"))
    assert "150.0 (bw 0.50, mma 0.10)" in row and "1.20x" in row and "1.12x" in row
    assert "WRONG 120.0" in row and "skipped" in row
    assert "| case | ion µs (frac) | ion-attn µs (frac) | fa3 µs (frac) |" in t
    assert "| prefill |" in t and "0.83x" in t
    assert "- decode / ion-attn: wrong: rel_err 0.5" in t and "- triton: skipped: no triton" in t
    seed = next(x for x in t.splitlines() if x.startswith("| seed |"))
    assert "11100 (11000–11200)" in seed and "1.088 (1.077–1.100)" in seed
    assert "ION@/t/tag/FA total" in t
    assert "| ION | 90.0 | 32.0 (30.0–34.0, n=3) |" in t  # only the states that ran
    assert "ION warm / FLASH_ATTN warm = 1.60" in t
    assert report.render_table({"records": []}).endswith("(no records)\n")


def test_render_writes_table_and_plot(tmp_path):
    report.update_summary(tmp_path, SUMMARY["records"], SUMMARY["ceilings"])
    table, plot = report.render(tmp_path)
    assert table.read_text() == report.render_table(report.load_summary(tmp_path))
    assert plot.stat().st_size > 5000
    only_startup = tmp_path / "s"
    report.update_summary(only_startup, SUMMARY["records"][-3:])
    assert report.render(only_startup)[1] is None  # nothing to plot


def test_results_dir_name():
    assert str(report.default_results_dir("NVIDIA H200", "2026-12-07")) == \
        "bench/results/2026-12-07-nvidia-h200"
