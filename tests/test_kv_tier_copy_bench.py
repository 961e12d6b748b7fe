"""CPU tests of scripts/kv_tier_copy_bench.py: job plan, checks that catch bad copies,
and the CPU run of the Ion worker paths."""

import numpy as np
import pytest
import torch

from script_loader import load_script

B = load_script("kv_tier_copy_bench.py", "kv_tier_copy_bench")

TINY = ["--layers", "3", "--num-gpu-blocks", "96", "--jobs", "3", "--blocks-per-job", "5",
        "--ring-mib", "1", "--rounds", "2", "--page", "16", "--kv-heads", "2",
        "--head-dim", "64"]


def test_plan_jobs_disjoint_and_sized():
    src, host, dst = B.plan_jobs(100, 4, 6, seed=3)
    assert [len(j) for j in src] == [6] * 4 == [len(j) for j in host] == [len(j) for j in dst]
    s, d = sum(src, []), sum(dst, [])
    assert len(set(s)) == 24 and len(set(d)) == 24 and not set(s) & set(d)
    assert sum(host, []) == list(range(24))
    assert B.plan_jobs(100, 4, 6, seed=3) == (src, host, dst)  # deterministic
    assert B.plan_jobs(100, 4, 6, seed=4)[0] != src
    assert B.plan_jobs(100, 4, 6, seed=3, ids="random")[0] != src
    with pytest.raises(ValueError, match="GPU blocks"):
        B.plan_jobs(40, 4, 6, seed=0)
    with pytest.raises(ValueError, match="ids"):
        B.plan_jobs(100, 4, 6, seed=0, ids="sorted")


@pytest.mark.parametrize("ids", ["runs", "random"])
def test_plan_jobs_id_patterns(ids):
    src, _, dst = B.plan_jobs(96, 4, 6, seed=5, ids=ids)
    s, d = sum(src, []), sum(dst, [])
    assert len(set(s + d)) == 48 and all(0 <= x < 96 for x in s + d)
    consecutive = all(b == a + 1 for j in src + dst for a, b in zip(j, j[1:]))
    assert consecutive == (ids == "runs")


def test_cpu_run_checks_every_block(capsys):
    ws = ["ion", "ion-cegather", "ion-noring", "ion-tensor", "ion-noring-tensor"]
    res = B.run(B.parse_args(TINY + ["--workers", ",".join(ws)]))
    assert set(res["summary"]) == set(ws)
    assert [(r["worker"], r["round"]) for r in res["rounds"]] == [
        (w, r) for r in range(2) for w in ws]  # interleaved
    for r in res["rounds"]:
        assert r["bad_host_blocks"] == 0 and r["bad_loaded_blocks"] == 0
        assert r["store"]["jobs"] == r["load"]["jobs"] == 3
        assert r["store"]["wall_gbps"] > 0 and r["load"]["wall_gbps"] > 0
    assert res["tensors"] == 3 and res["block_bytes"] == 3 * 2 * 2 * 16 * 64 * 2


def test_a_corrupting_copy_is_caught(monkeypatch, tmp_path):
    from ion_vllm.kv_tier.worker import TorchCopier

    class Bad(TorchCopier):
        def to_host(self, host, group, gpu_ids, host_ids):
            super().to_host(host, group, gpu_ids, host_ids)
            host[int(host_ids[0]), 3] ^= 0x01

    real = B.build_worker

    def build(name, canonical, n, ring_mib):
        w = real(name, canonical, n, ring_mib)
        w.copier = Bad(w.tensors, w.offsets, w.copier.group_refs, layout=w.host_layout,
                       page_bytes=w.page_bytes)
        return w

    monkeypatch.setattr(B, "build_worker", build)
    rc = B.main(TINY + ["--workers", "ion-noring,ion-noring-tensor", "--out", str(tmp_path)])
    assert rc == 1
    import json

    res = json.loads((tmp_path / "copy_bench.json").read_text())
    assert res["summary"]["ion-noring"]["bad_blocks"] > 0
    assert res["summary"]["ion-noring-tensor"]["bad_blocks"] > 0
    assert "| ion-noring |" in (tmp_path / "copy_bench.md").read_text()


def test_native_needs_cuda_and_unknown_workers_are_refused():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(SystemExit, match="CUDA"):
        B.run(B.parse_args(TINY + ["--workers", "native"]))
    with pytest.raises(SystemExit, match="unknown worker"):
        B.run(B.parse_args(TINY + ["--workers", "ion,foo"]))


def test_caches_are_random_bf16_in_the_ion_layout():
    c = B.make_caches(2, 8, 2, 16, 64, "cpu", seed=1)
    assert len(c) == 2 and c[0].shape == (8, 2, 2, 16, 64) and c[0].dtype == torch.bfloat16
    assert not torch.equal(c[0], c[1]) and c[0].float().abs().sum() > 0
    assert np.isfinite(c[0].float().numpy()).all()
