"""CPU tests of scripts/kv_tier_host_cost.py: it drives the worker's store and load entry
points under both issue points, checks every stored and loaded block, and fails when a
copy is wrong (the GPU numbers come from the same code on CUDA)."""

import json

import pytest

from script_loader import load_script

H = load_script("kv_tier_host_cost.py", "kv_tier_host_cost")

TINY = ["--layers", "2", "--num-gpu-blocks", "24", "--blocks", "1,3", "--reps", "3",
        "--ring-mib", "1", "--page", "16", "--kv-heads", "2", "--head-dim", "32"]


def test_cpu_run_checks_every_block_and_writes_results(tmp_path):
    rc = H.main(TINY + ["--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "host_cost.json").read_text())
    assert [(w["issue_api"], w["id_upload"], w["issue_at"]) for w in res["workers"]] == [
        ("torch", "pin_memory", "submit"), ("torch", "pin_memory", "finish"),
        ("torch", "staged", "submit"), ("torch", "staged", "finish"),
        ("raw", "pin_memory", "submit"), ("raw", "pin_memory", "finish")]
    for w in res["workers"]:
        assert w["bad_blocks"] == 0
        assert set(w["by_blocks"]) == {"1", "3"}
        for d in w["by_blocks"].values():
            assert d["submit_store"]["n"] == 3 and d["submit_store"]["median_us"] > 0
    md = (tmp_path / "host_cost.md").read_text()
    assert "| torch | finish | staged | 3 |" in md and "| raw | submit | stage | 1 |" in md
    assert "parts" not in res  # no CUDA: no per-operation table


def test_a_wrong_drain_is_counted_and_fails_the_run(tmp_path, monkeypatch):
    from ion_vllm.kv_tier import worker as W

    real = W.TorchCopier.drain

    def drain_shifted(self, ring, start, host, host_ids):  # writes the wrong host rows
        real(self, ring, start, host, (host_ids + 1) % host.shape[0])

    monkeypatch.setattr(W.TorchCopier, "drain", drain_shifted)
    rc = H.main(TINY + ["--issue-at", "finish", "--id-upload", "staged", "--issue-api",
                        "torch", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "host_cost.json").read_text())
    assert rc == 1 and res["workers"][0]["bad_blocks"] > 0


def test_unknown_issue_point_is_refused():
    import pytest

    with pytest.raises(SystemExit, match="issue point"):
        H.main(TINY + ["--issue-at", "later"])
    with pytest.raises(SystemExit, match="id upload"):
        H.main(TINY + ["--id-upload", "mmap"])
    with pytest.raises(SystemExit, match="issue api"):
        H.main(TINY + ["--issue-api", "cuda"])


def test_a_wrong_raw_drain_is_counted_and_fails_the_run(tmp_path, monkeypatch):
    """The raw path's pointer drain, one row off: the script counts bad blocks."""
    from ion_vllm.kv_tier import raw_issue as R

    real = R.PointerDrain.__call__

    def shifted(self, start, host_ids, stream):
        real(self, start, [(h + 1) % 12 for h in host_ids], stream)

    monkeypatch.setattr(R.PointerDrain, "__call__", shifted)
    rc = H.main(TINY + ["--issue-api", "raw", "--issue-at", "submit", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "host_cost.json").read_text())
    assert rc == 1 and res["workers"][0]["bad_blocks"] > 0


def test_breakdown_splits_each_entry_point_into_its_parts(tmp_path):
    from ion_vllm.kv_tier import page_gather
    from ion_vllm.kv_tier import worker as W

    before = (page_gather._device_ids, W._flatten)
    rc = H.main(TINY + ["--breakdown", "3", "--out", str(tmp_path)])
    assert rc == 0
    assert (page_gather._device_ids, W._flatten) == before  # module functions restored
    res = json.loads((tmp_path / "host_cost.json").read_text())
    bd = {(w["id_upload"], w["issue_at"]): w for w in res["breakdowns"]
          if w["issue_api"] == "torch"}
    assert set(bd) == {("pin_memory", "submit"), ("pin_memory", "finish"),
                       ("staged", "submit"), ("staged", "finish")}
    raw = {w["issue_at"]: w["breakdown"] for w in res["breakdowns"] if w["issue_api"] == "raw"}
    assert set(raw) == {"submit", "finish"}
    # the raw path's drain: pointer copies (memmove on the CPU), inside submit_store under
    # "submit" and inside the next get_finished under "finish"; the torch copier's drain
    # never runs there
    for part in ("ptr_drain", "ptr_copy.copy", "rt.launch_on"):
        assert part in raw["submit"]["submit_store"]["parts"]
        assert part not in raw["finish"]["submit_store"]["parts"]
        assert part in raw["finish"]["get_finished after store"]["parts"]
    assert all("copier.drain" not in d["parts"] for b in raw.values() for d in b.values())
    for w in bd.values():
        assert w["bad_blocks"] == 0 and set(w["by_blocks"]) == {"3"}
        for entry, d in w["breakdown"].items():
            assert d["calls"] == 3  # the timed rounds only, not the warm-up or the polls
            assert d["total_us"] >= max(d["parts"].values()) > 0
    sub, fin = bd[("pin_memory", "submit")]["breakdown"], bd[("pin_memory", "finish")]["breakdown"]
    assert set(sub) == set(fin) == {"submit_store", "get_finished after store", "submit_load",
                                    "get_finished after load"}
    # the copies run inside submit_store under "submit", inside the next get_finished
    # under "finish"
    for part in ("ring_gather", "copier.drain", "_issue_ring_piece"):
        assert part in sub["submit_store"]["parts"]
        assert part not in fin["submit_store"]["parts"]
        assert part in fin["get_finished after store"]["parts"]
    assert "load_to_gpu" in sub["submit_load"]["parts"]
    assert "load_to_gpu" in fin["get_finished after load"]["parts"]
    md = (tmp_path / "host_cost.md").read_text()
    assert ("In-flow breakdown, issue api torch, issue_at=finish, id upload staged, jobs of "
            "3 blocks") in md


def test_host_clock_counts_exclusive_time_per_entry_point():
    import time

    clock = H.HostClock()
    inner = clock.wrap("inner", lambda: time.sleep(0.03))

    def outer_fn():
        time.sleep(0.02)
        inner()

    outer = clock.wrap("outer", outer_fn)
    outer()
    inner()  # called alone: an entry point of its own
    clock.recording = False
    outer()  # timed, not kept
    s = clock.summary()
    assert s["outer"]["calls"] == 1 and s["inner"]["calls"] == 1
    o = s["outer"]["parts"]
    assert 0.018e6 <= o["outer"] < 0.028e6 and 0.028e6 <= o["inner"] < 0.045e6
    assert s["outer"]["total_us"] == pytest.approx(o["outer"] + o["inner"])
    assert set(s["inner"]["parts"]) == {"inner"}
