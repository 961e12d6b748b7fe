"""scripts/device_tree.sh: the old result folders leave the working tree for device calls
(64 MiB limit) and come back, and nothing a commit could pick up changes meanwhile."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _repo(tmp_path):
    repo = tmp_path / "r"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "device_tree.sh"), repo / "scripts")
    for d in ("2026-01-01-h200", "2026-01-02-cpu", "2026-01-03-h100", "2026-01-04-h200"):
        (repo / "bench" / "results" / d / "sub").mkdir(parents=True)
        (repo / "bench" / "results" / d / "sub" / "r.json").write_text(d * 100)
    (repo / "bench" / "notes.md").write_text("notes\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return repo


def _run(repo, *args, env=None) -> str:
    return subprocess.run(["bash", str(repo / "scripts" / "device_tree.sh"), *args],
                          check=True, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}).stdout


def test_trim_leaves_old_results_out_and_restore_brings_them_back(tmp_path):
    repo = _repo(tmp_path)
    full = int(_run(repo, "size").split()[0])
    out = _run(repo, "trim")
    res = repo / "bench" / "results"
    assert sorted(os.listdir(res)) == ["2026-01-03-h100", "2026-01-04-h200"]
    assert "2026-01-01-h200" in out and "2026-01-02-cpu" in out
    assert (repo / "bench" / "notes.md").exists() and (repo / "scripts").is_dir()
    assert int(out.split("\n")[-2].split()[0]) < full
    # nothing to commit: the left-out files are not deletions
    assert _git(repo, "status", "--porcelain") == ""
    _git(repo, "add", "-A")
    assert _git(repo, "diff", "--cached", "--name-only") == ""
    _run(repo, "restore")
    assert len(os.listdir(res)) == 4
    assert (res / "2026-01-01-h200" / "sub" / "r.json").read_text() == "2026-01-01-h200" * 100
    assert int(_run(repo, "size").split()[0]) == full
    assert _git(repo, "status", "--porcelain") == ""


def test_keep_sets_how_many_newest_dates_stay(tmp_path):
    repo = _repo(tmp_path)
    _run(repo, "trim", env={"KEEP": "1"})
    assert os.listdir(repo / "bench" / "results") == ["2026-01-04-h200"]
    _run(repo, "restore")


def test_bad_verb_is_refused(tmp_path):
    repo = _repo(tmp_path)
    r = subprocess.run(["bash", str(repo / "scripts" / "device_tree.sh"), "prune"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "usage" in r.stderr
