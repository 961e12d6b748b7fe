"""ion-bench kernel on a Hopper GPU: one small-iteration run of a decode and a mixed case,
every ION backend, FA3 and a backend registered by name (as a script registers another
checkout's kernels), interleaved; records, ceilings and the fp32-reference check."""

import pytest

from ion_vllm.bench import cli, kernel_runner, report

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = ["decode-32x8192-h28/4-d128", "mixed-32x8192+p2048-h28/4-d128"]


def test_kernel_bench_ion_vs_fa3(tmp_path, monkeypatch):
    monkeypatch.setitem(kernel_runner.BACKENDS, "extra", kernel_runner.ion_backend("attn"))
    rc = cli.main(["kernel", "--case", ",".join(CASES),
                   "--backends", "ion,ion-attn,ion-append,extra,fa3,fa3-layer",
                   "--iters", "8", "--warmup", "2", "--out", str(tmp_path)])
    s = report.load_summary(tmp_path)
    assert 1000 < s["ceilings"]["copy_gbps"] < 10000 and 100 < s["ceilings"]["gemm_tflops"] < 2000
    recs = {(r["case"], r["backend"]): r for r in s["records"]}
    for case in CASES:
        for b in ("ion", "ion-attn", "ion-append", "extra", "fa3", "fa3-layer"):
            r = recs[(case, b)]
            assert r["status"] == "ok", (case, b, r.get("error"), r.get("rel_err"))
            assert r["rel_err"] < kernel_runner.REL_TOL
            assert r["timing"] == "interleaved" and len(r["iter_us"]) == r["iters"] == 8
            assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
        assert 0.05 < recs[(case, "fa3")]["frac_copy_bw"] < 1.2
    assert rc == 0
    assert (tmp_path / "table.md").exists() and (tmp_path / "plot.png").exists()
