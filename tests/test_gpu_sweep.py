"""Reduced randomized GPU sweep (24 cases) of kv_append + ion_attention, plus a
negative control proving the sweep fails on a broken block table."""

import json

import pytest
import torch
from script_loader import load_script


# tests/conftest.py skips `gpu` tests without a Hopper GPU; this guard only keeps the
# file harmless where that conftest is absent.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _load():
    return load_script("gpu_sweep.py", "gpu_sweep_gpu_test")


@pytest.mark.gpu
@needs_cuda
def test_reduced_sweep_passes(tmp_path):
    sw = _load()
    out = tmp_path / "sweep"
    n = 2 * sw.CYCLE * len(sw.TILE_MS)  # every (ratio, head size, path, tile size) once
    rc = sw.main(["--cases", str(n), "--out", str(out), "--quiet", "--max-kv-tokens", "8192"])
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "cases.jsonl").read_text().splitlines()
    assert len(lines) == n
    bad = [json.loads(x) for x in lines if not json.loads(x)["pass"]]
    assert rc == 0 and summary["verdict"] == "PASS", (summary["seed"], bad[:3])
    assert summary["passed"] == n and summary["cases_with_split_kv"] > 0
    # both paths, every tile size, all GQA ratios and head sizes were exercised
    keys = [k.split("/") for k in summary["by_variant"]]
    assert {k[2] for k in keys} == {f"G{g}" for g in sw.GQA_RATIOS}
    assert {k[1] for k in keys} == {f"D{d}" for d in sw.HEAD_DIMS}
    assert {k[3] for k in keys} == set(sw.PATHS)
    assert {k[4] for k in keys} == {f"m{t}" for t in sw.TILE_MS}


@pytest.mark.gpu
@needs_cuda
def test_sweep_detects_broken_block_table(tmp_path):
    sw = _load()
    out = tmp_path / "fault"
    rc = sw.main(["--cases", "4", "--seed", "99", "--out", str(out), "--quiet",
                  "--fault", "spare_pages"])
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 1
    assert summary["failed"] == 4 and summary["verdict"] == "FAIL"
