"""CPU tests of scripts/kv_tier_host_cost.py: it drives the worker's store and load entry
points under both issue points, checks every stored and loaded block, and fails when a
copy is wrong (the GPU numbers come from the same code on CUDA)."""

import json

from script_loader import load_script

H = load_script("kv_tier_host_cost.py", "kv_tier_host_cost")

TINY = ["--layers", "2", "--num-gpu-blocks", "24", "--blocks", "1,3", "--reps", "3",
        "--ring-mib", "1", "--page", "16", "--kv-heads", "2", "--head-dim", "32"]


def test_cpu_run_checks_every_block_and_writes_results(tmp_path):
    rc = H.main(TINY + ["--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "host_cost.json").read_text())
    assert [(w["id_upload"], w["issue_at"]) for w in res["workers"]] == [
        ("pin_memory", "submit"), ("pin_memory", "finish"),
        ("staged", "submit"), ("staged", "finish")]
    for w in res["workers"]:
        assert w["bad_blocks"] == 0
        assert set(w["by_blocks"]) == {"1", "3"}
        for d in w["by_blocks"].values():
            assert d["submit_store"]["n"] == 3 and d["submit_store"]["median_us"] > 0
    md = (tmp_path / "host_cost.md").read_text()
    assert "| finish | staged | 3 |" in md and "parts" not in res  # no CUDA: no per-operation table


def test_a_wrong_drain_is_counted_and_fails_the_run(tmp_path, monkeypatch):
    from ion_vllm.kv_tier import worker as W

    real = W.TorchCopier.drain

    def drain_shifted(self, ring, start, host, host_ids):  # writes the wrong host rows
        real(self, ring, start, host, (host_ids + 1) % host.shape[0])

    monkeypatch.setattr(W.TorchCopier, "drain", drain_shifted)
    rc = H.main(TINY + ["--issue-at", "finish", "--id-upload", "staged",
                        "--out", str(tmp_path)])
    res = json.loads((tmp_path / "host_cost.json").read_text())
    assert rc == 1 and res["workers"][0]["bad_blocks"] > 0


def test_unknown_issue_point_is_refused():
    import pytest

    with pytest.raises(SystemExit, match="issue point"):
        H.main(TINY + ["--issue-at", "later"])
    with pytest.raises(SystemExit, match="id upload"):
        H.main(TINY + ["--id-upload", "mmap"])
