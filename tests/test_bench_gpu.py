"""ion-bench kernel on a Hopper GPU: one small-iteration run of the smoke decode
case, ION vs FA3, checking timing records, ceilings and the ION/FA3 cross-check."""

import pytest

from ion_vllm.bench import cli, report

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASE = "decode-32x8192-h28/4-d128"


def test_kernel_bench_ion_vs_fa3(tmp_path):
    rc = cli.main(["kernel", "--case", CASE, "--backends", "fa3,ion,triton",
                   "--iters", "8", "--warmup", "2", "--out", str(tmp_path)])
    assert rc == 0
    s = report.load_summary(tmp_path)
    c = s["ceilings"]
    assert 1000 < c["copy_gbps"] < 10000          # H200: ~4 TB/s peak
    assert 100 < c["gemm_tflops"] < 2000
    recs = {r["backend"]: r for r in s["records"] if r["case"] == CASE}
    assert set(recs) == {"fa3", "ion", "triton"}
    fa3 = recs["fa3"]
    assert fa3["status"] == "ok", fa3.get("error")
    assert fa3["p10_us"] <= fa3["median_us"] <= fa3["p90_us"]
    assert 0.05 < fa3["frac_copy_bw"] < 1.2
    assert fa3["rotations"] >= 2
    # every timed call is kept, in order, and the summary statistics come from them
    assert len(fa3["iter_us"]) == fa3["iters"] == 8
    assert min(fa3["iter_us"]) == pytest.approx(fa3["min_us"], abs=0.01)
    for name in ("ion", "triton"):
        r = recs[name]
        assert r["status"] in ("ok", "skipped", "error")
        if r["status"] == "ok":
            assert r["rel_err_vs_fa3"] < 2e-2, (name, r["rel_err_vs_fa3"])
    assert recs["ion"]["status"] == "ok", recs["ion"].get("error")
    assert (tmp_path / "table.md").exists() and (tmp_path / "plot.png").exists()
