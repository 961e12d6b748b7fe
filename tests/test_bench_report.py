"""summary.json merging, e2e aggregation, table.md and plot.png rendering (CPU)."""

import json

import pytest

from ion_vllm.bench import report

# A recorded summary (shape of what `ion-bench kernel` + `ion-bench e2e` write).
FIXTURE = json.loads(r"""
{
  "ceilings": {"copy_gbps": 4000.0, "gemm_tflops": 800.0, "gpu": "NVIDIA H200",
               "date": "2026-11-29", "versions": {"torch": "2.11.0", "vllm": "0.26.0"}},
  "records": [
    {"suite": "kernel", "case": "decode-32x8192-h28/4-d128", "backend": "ion", "status": "ok",
     "median_us": 150.0, "p10_us": 149.0, "p90_us": 152.0, "bytes": 537329664,
     "flops": 3758096384, "frac_copy_bw": 0.8955, "frac_gemm": 0.0313,
     "rel_err_vs_fa3": 0.003},
    {"suite": "kernel", "case": "decode-32x8192-h28/4-d128", "backend": "fa3", "status": "ok",
     "median_us": 180.0, "p10_us": 179.0, "p90_us": 183.0, "bytes": 537329664,
     "flops": 3758096384, "frac_copy_bw": 0.7463, "frac_gemm": 0.0261},
    {"suite": "kernel", "case": "decode-32x8192-h28/4-d128", "backend": "fa4",
     "status": "error", "error": "RuntimeError: boom"},
    {"suite": "kernel", "case": "decode-32x8192-h28/4-d128", "backend": "triton",
     "status": "skipped", "error": "triton unified_attention import failed"},
    {"suite": "kernel", "case": "prefill-1x8192-h28/4-d128", "backend": "ion", "status": "ok",
     "median_us": 1200.0, "p10_us": 1190.0, "p90_us": 1210.0, "bytes": 134217728,
     "flops": 481095057408, "frac_copy_bw": 0.028, "frac_gemm": 0.501},
    {"suite": "kernel", "case": "prefill-1x8192-h28/4-d128", "backend": "fa3", "status": "ok",
     "median_us": 1000.0, "p10_us": 990.0, "p90_us": 1010.0, "bytes": 134217728,
     "flops": 481095057408, "frac_copy_bw": 0.0336, "frac_gemm": 0.601},
    {"suite": "e2e", "case": "seed", "backend": "ION", "status": "ok", "repeats": 2,
     "runs": [{"total_tok_s": 11000.0, "output_tok_s": 700.0},
              {"total_tok_s": 11200.0, "output_tok_s": 712.0}],
     "total_tok_s": 11100.0, "total_tok_s_min": 11000.0, "total_tok_s_max": 11200.0,
     "output_tok_s": 706.0, "output_tok_s_min": 700.0, "output_tok_s_max": 712.0},
    {"suite": "e2e", "case": "seed", "backend": "FLASH_ATTN", "status": "ok", "repeats": 2,
     "runs": [{"total_tok_s": 10000.0, "output_tok_s": 640.0},
              {"total_tok_s": 10400.0, "output_tok_s": 660.0}],
     "total_tok_s": 10200.0, "total_tok_s_min": 10000.0, "total_tok_s_max": 10400.0,
     "output_tok_s": 650.0, "output_tok_s_min": 640.0, "output_tok_s_max": 660.0}
  ]
}
""")


def test_merge_replaces_matching_and_keeps_others():
    old = [{"suite": "kernel", "case": "a", "backend": "ion", "median_us": 1},
           {"suite": "kernel", "case": "a", "backend": "fa3", "median_us": 2},
           {"suite": "e2e", "case": "a", "backend": "ION", "total_tok_s": 3}]
    new = [{"suite": "kernel", "case": "a", "backend": "fa3", "median_us": 20},
           {"suite": "kernel", "case": "b", "backend": "fa3", "median_us": 5}]
    out = report.merge_records(old, new)
    assert [(r["case"], r["backend"], r.get("median_us")) for r in out] == [
        ("a", "ion", 1), ("a", "fa3", 20), ("a", "ION", None), ("b", "fa3", 5)]
    # same case/backend in another suite is a different record
    assert any(r["suite"] == "e2e" for r in out)


def test_update_summary_roundtrip_and_ceilings(tmp_path):
    d = tmp_path / "res"
    report.update_summary(d, FIXTURE["records"][:2], FIXTURE["ceilings"])
    s = report.update_summary(d, [{"suite": "kernel", "case": "decode-32x8192-h28/4-d128",
                                   "backend": "ion", "median_us": 140.0, "status": "ok"}],
                              {"gpu": "NVIDIA H200", "copy_gbps": None,
                               "versions": {"ion-vllm": "0.1"}})
    on_disk = json.loads((d / "summary.json").read_text())
    assert on_disk == s
    assert len(s["records"]) == 2
    assert s["records"][0]["median_us"] == 140.0
    assert s["ceilings"]["copy_gbps"] == 4000.0  # None never erases a measured ceiling
    assert s["ceilings"]["versions"] == {"torch": "2.11.0", "vllm": "0.26.0", "ion-vllm": "0.1"}


def test_load_summary_accepts_bare_list(tmp_path):
    p = tmp_path / "summary.json"
    p.write_text(json.dumps([{"suite": "ceilings", "copy_gbps": 1.0},
                             {"suite": "kernel", "case": "x", "backend": "ion"}]))
    s = report.load_summary(tmp_path)
    assert s["ceilings"] == {"copy_gbps": 1.0}
    assert s["records"] == [{"suite": "kernel", "case": "x", "backend": "ion"}]
    assert report.load_summary(tmp_path / "missing") == report.empty_summary()


def test_e2e_aggregate_and_ratio():
    agg = report.e2e_aggregate([{"total_tok_s": 10.0, "output_tok_s": 1.0},
                                {"total_tok_s": 14.0, "output_tok_s": 3.0}])
    assert agg == {"repeats": 2, "total_tok_s": 12.0, "total_tok_s_min": 10.0,
                   "total_tok_s_max": 14.0, "output_tok_s": 2.0, "output_tok_s_min": 1.0,
                   "output_tok_s_max": 3.0}
    ion, fa = FIXTURE["records"][6], FIXTURE["records"][7]
    r = report.e2e_ratio(ion, fa)
    assert r["ratio"] == pytest.approx(11100 / 10200)
    assert r["ratio_min"] == pytest.approx(min(11000 / 10000, 11200 / 10400))
    assert r["ratio_max"] == pytest.approx(max(11000 / 10000, 11200 / 10400))
    assert r["pairs"] == 2
    assert report.e2e_ratio({"runs": []}, fa) is None


def test_slug_and_default_dir():
    assert report.slugify("NVIDIA H200 (141GB)") == "nvidia-h200-141gb"
    d = report.default_results_dir("NVIDIA H200", "2026-11-29")
    assert str(d).replace("\\", "/") == "bench/results/2026-11-29-nvidia-h200"


def test_table_rows_and_speedups():
    t = report.render_table(FIXTURE)
    lines = t.splitlines()
    dec = next(line for line in lines if line.startswith("| decode-32x8192-h28/4-d128 |"))
    assert "150.0 (bw 0.90, mma 0.03)" in dec
    assert "180.0 (bw 0.75, mma 0.03)" in dec
    assert dec.rstrip().endswith("| 1.20x |")       # 180 / 150
    assert "| error |" in dec and "| skipped |" in dec
    pre = next(line for line in lines if line.startswith("| prefill-1x8192-h28/4-d128 |"))
    assert pre.rstrip().endswith("| 0.83x |")       # 1000 / 1200
    seed = next(line for line in lines if line.startswith("| seed |"))
    assert "11100 (11000–11200)" in seed and "10200 (10000–10400)" in seed
    assert f"{11100 / 10200:.3f} ({11200 / 10400:.3f}–{11000 / 10000:.3f})" in seed
    assert "copy ceiling: 4000 GB/s" in t and "NVIDIA H200" in t
    assert "triton: skipped: triton unified_attention import failed" in t


def test_plot_and_render(tmp_path):
    report.save_summary(tmp_path, FIXTURE)
    table, plot = report.render(tmp_path)
    assert table.read_text() == report.render_table(FIXTURE)
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    import matplotlib.image as mpimg
    img = mpimg.imread(plot)
    assert img.shape[0] > 400 and img.shape[1] > 600
    assert img.std() > 0.01  # not a blank canvas


def test_plot_none_without_baseline(tmp_path):
    s = {"ceilings": {}, "records": [{"suite": "kernel", "case": "x", "backend": "ion",
                                      "status": "ok", "median_us": 1.0}]}
    assert report.render_plot(s, tmp_path / "p.png") is None
    assert "| x |" in report.render_table(s)


def test_table_one_speedup_column_per_ion_variant_and_serve_header():
    """A run of several ION variants (ion-auto, ion-auto-rc) gets one FA3 speed-up column
    each (not a blank ION/FA3); serve-mode workloads name the serve tools in the heading."""
    rec = lambda b, us: {"suite": "kernel", "case": "c", "backend": b, "status": "ok",
                         "median_us": us}
    s = {"ceilings": {}, "records": [rec("ion-auto", 150.0), rec("ion-auto-rc", 120.0),
                                     rec("fa3", 132.0)]}
    t = report.render_table(s)
    head = next(line for line in t.splitlines() if line.startswith("| case |"))
    assert "| ion-auto/FA3 | ion-auto-rc/FA3 |" in head
    row = next(line for line in t.splitlines() if line.startswith("| c |"))
    assert row.rstrip().endswith(f"| {132 / 150:.2f}x | {132 / 120:.2f}x |")
    assert "`vllm bench throughput`" in report.render_table(FIXTURE)
    serve = [dict(r, case="seed-serve") for r in FIXTURE["records"] if r["suite"] == "e2e"]
    t2 = report.render_table({"ceilings": {}, "records": serve})
    assert "`vllm bench serve` against `vllm serve`" in t2
    assert "`vllm bench throughput`" not in t2


def test_table_states_the_timing_method():
    rec = lambda b, us, t: {"suite": "kernel", "case": "c", "backend": b, "status": "ok",
                            "median_us": us, "timing": t}
    t = report.render_table({"ceilings": {}, "records": [rec("ion-auto", 150.0, "interleaved"),
                                                         rec("fa3", 132.0, "interleaved")]})
    assert "Timing: interleaved (" in t
    t = report.render_table({"ceilings": {}, "records": [rec("fa3", 132.0, "queued"),
                                                         rec("ion-auto", 1.0, "interleaved")]})
    assert "Timing: interleaved, queued (" in t
