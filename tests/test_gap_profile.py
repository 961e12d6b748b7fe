"""CPU checks of the compute stream's idle-time analysis (ion_vllm/bench/gap_profile.py)
on a hand-made activity list whose answers are worked out below, and of the timeline's
round trip through its compressed file."""

import pytest

from ion_vllm.bench import gap_profile as gp


def _act(stream, start, end, name, kind="kernel", nbytes=0):
    return {"stream": stream, "start": start, "end": end, "kind": kind, "name": name,
            "bytes": nbytes, "corr": None}


def _acts():
    """Compute stream "7": gaps of 0.5 (A->B), 3 (B->A), 150 (A->C), 990 (C->A) and 5 us
    (A->B); two overlapping kernels (23-30, 25-40) and a back-to-back pair (40) leave
    none.  Stream "9": one DtoH copy of 1 MiB at 100-110 us; a memset on "7" is not a
    kernel."""
    acts = [_act("7", 0, 10, "A"), _act("7", 10.5, 20, "B"), _act("7", 23, 30, "A"),
            _act("7", 25, 40, "B"), _act("7", 40, 50, "A"), _act("7", 200, 210, "C"),
            _act("7", 1200, 1210, "A"), _act("7", 1215, 1300, "B"),
            _act("9", 100, 110, "Memcpy DtoH", kind="DtoH", nbytes=1 << 20),
            _act("7", 600, 601, "Memset", kind="memset")]
    return sorted(acts, key=lambda a: a["start"])


def test_idle_intervals_merge_overlaps_and_name_the_kernels_around_each_gap():
    gaps = gp.idle_intervals(_acts(), "7")
    assert [(g[0], g[1]) for g in gaps] == [(10, 10.5), (20, 23), (50, 200), (210, 1200),
                                           (1210, 1215)]
    assert [(g[2], g[3]) for g in gaps] == [("A", "B"), ("B", "A"), ("A", "C"), ("C", "A"),
                                           ("A", "B")]
    # the memset at 600 us does not split the 990 us gap: kernels only
    assert gp.idle_intervals(_acts(), "9") == []
    # float noise between back-to-back kernels (under 1 ns) is no gap
    noisy = [_act("7", 0, 0.3, "A"), _act("7", 0.1 + 0.2, 1.0, "B"), _act("7", 1.002, 2, "C")]
    assert [(g[2], g[3]) for g in gp.idle_intervals(noisy, "7")] == [("B", "C")]


def test_gap_histogram_bins_by_size():
    h = gp.gap_histogram(gp.idle_intervals(_acts(), "7"))
    got = {(r["lo"], r["hi"]): (r["count"], r["us"]) for r in h}
    assert got[(0.0, 1.0)] == (1, 0.5) and got[(2.0, 5.0)] == (1, 3.0)
    assert got[(5.0, 10.0)] == (1, 5.0)  # a gap of exactly 5 us is in the 5-10 bin
    assert got[(100.0, 1000.0)] == (2, 1140.0) and got[(1000.0, None)] == (0, 0.0)
    assert sum(r["count"] for r in h) == 5


def test_idle_near_and_far_from_side_work():
    """Within 100 us of the copy (100-110): 0-210 us of the span, holding 0.5 + 3 + 150 us
    of idle; the rest (1,090 us) holds 995."""
    r = gp.idle_near_side_work(_acts(), "7", near_us=100.0)
    assert r["near"]["span_us"] == pytest.approx(210.0)
    assert r["near"]["idle_us"] == pytest.approx(153.5)
    assert r["far"]["span_us"] == pytest.approx(1090.0)
    assert r["far"]["idle_us"] == pytest.approx(995.0)
    assert r["far"]["idle_share"] == pytest.approx(995.0 / 1090.0)
    # a copy under 64 KiB (the engine's own per-step copies) is not side work
    small = [dict(a, bytes=60) if a["stream"] == "9" else a for a in _acts()]
    assert gp.idle_near_side_work(small, "7", near_us=100.0)["near"]["span_us"] == 0.0
    assert gp.idle_near_side_work(small, "7", near_us=100.0,
                                  min_copy_bytes=0)["near"]["span_us"] == pytest.approx(210.0)
    lone = [a for a in _acts() if a["stream"] == "7"]
    r = gp.idle_near_side_work(lone, "7", near_us=100.0)
    assert r["near"]["span_us"] == 0.0 and r["far"]["idle_us"] == pytest.approx(1148.5)


def test_window_idle_quantiles():
    """13 windows of 100 us: idle 53.5, 100, 90, nine all idle, 5."""
    r = gp.window_idle(_acts(), "7", window_us=100.0, quantiles=(0.0, 0.5, 1.0))
    assert r["windows"] == 13
    q = r["quantiles"]
    assert q["0.0"] == pytest.approx(0.05) and q["0.5"] == pytest.approx(1.0)
    assert q["1.0"] == pytest.approx(1.0)
    # 1,300 us in 800 us windows: one full (idle 0.5 + 3 + 150 + 590) and a last one of
    # 500 us, kept (at least half a window; idle 400 + 5)
    r = gp.window_idle(_acts(), "7", window_us=800.0, quantiles=(0.0, 1.0))
    assert r["windows"] == 2
    assert r["quantiles"]["0.0"] == pytest.approx(405.0 / 500.0)
    assert r["quantiles"]["1.0"] == pytest.approx(743.5 / 800.0)
    # in 1,000 us windows the last 300 us (under half a window) are dropped
    r = gp.window_idle(_acts(), "7", window_us=1000.0, quantiles=(0.5,))
    assert r["windows"] == 1 and r["quantiles"]["0.5"] == pytest.approx(943.5 / 1000.0)


def test_gap_pairs_rank_short_gaps_by_the_kernels_around_them():
    rows = gp.gap_pairs(gp.idle_intervals(_acts(), "7"), below_us=20.0)
    assert [(r["before"], r["after"], r["count"]) for r in rows] == [("A", "B", 2),
                                                                    ("B", "A", 1)]
    assert rows[0]["us"] == pytest.approx(5.5) and rows[0]["mean_us"] == pytest.approx(2.75)


def test_the_timeline_file_round_trips_into_the_same_summary(tmp_path):
    acts = _acts()
    path = str(tmp_path / "t.npz")
    gp.save_timeline(path, acts, "7")
    back = gp.load_timeline(path)
    assert len(back) == len(acts)
    assert [(a["stream"], a["kind"]) for a in back] == [(a["stream"], a["kind"]) for a in acts]
    assert gp.summarize_gaps(back, "7") == gp.summarize_gaps(acts, "7")
    z = gp.timeline_arrays(acts, "7")
    assert list(z["names"]) == ["A", "B", "C"] and z["s_bytes"].sum() == 1 << 20


def test_markdown_lines_render_every_table():
    g = gp.summarize_gaps(_acts(), "7", near_us=100.0, window_us=100.0)
    lines = gp.markdown_lines([("ion", g), ("ion-noring", g)])
    rows = [ln for ln in lines if ln.startswith("| ion |")]
    assert len(rows) == 3
    assert rows[0].startswith("| ion | 1.1 | 0.0 (1) | 0.0 (0) | 0.0 (1) | 0.0 (1) |")
    assert "| 0.2, 0.2 (0.7310) | 1.1, 1.0 (0.9128) |" in rows[1]
    assert rows[2] == "| ion | A -> B: 0.01, 2, 2.75; B -> A: 0.00, 1, 3.00 |"
    assert gp.markdown_lines([]) == []


def test_pair_deltas_find_the_boundary_that_grew():
    """B is A with the A -> B boundaries 2 us longer each: that pair leads, +4 us over its
    two gaps at equal counts; B -> A is unchanged and ranks below it."""
    a = gp.idle_intervals(_acts(), "7")
    b = [(g0, g1 + 2.0, x, y) if (x, y) == ("A", "B") else (g0, g1, x, y)
         for g0, g1, x, y in a]
    rows = gp.pair_deltas(a, b)
    assert (rows[0]["before"], rows[0]["after"]) == ("A", "B")
    assert (rows[0]["count_a"], rows[0]["count_b"]) == (2, 2)
    assert rows[0]["delta_us"] == pytest.approx(4.0)
    assert rows[1]["delta_us"] == 0.0
    # a pair only one side has counts zero on the other
    only_b = gp.pair_deltas([], b)
    assert all(r["count_a"] == 0 and r["us_a"] == 0.0 for r in only_b)


def test_top_idle_windows_rank_bursts():
    """100 us windows: [100, 300) and nine more are all idle; the first window holds 53.5."""
    rows = gp.top_idle_windows(_acts(), "7", window_us=100.0, top=12)
    assert rows[0] == {"start_ms": 0.1, "idle_us": 100.0}
    assert {"start_ms": 0.0, "idle_us": 53.5} in rows
    assert rows[-1]["idle_us"] <= rows[0]["idle_us"]
    assert gp.top_idle_windows([], "7") == []


def test_idle_after_side_kernels_bins_each_boundary_by_the_last_side_kernel():
    """Compute stream "7": kernels of 10 us at 0, 11, 30, 1300, 3000, 20,000, 20,012 and
    20,030 us, so boundaries at 11 (gap 1), 30 (gap 9), 1300 (gap 1,260: not short), 3000
    (gap 1,690: not short), 20,000 (gap 16,990: not short), 20,012 (gap 2) and 20,030
    (gap 8).  Stream "9": one kernel at 20-40 us, which the boundary at 30 falls in; the
    copy on "8" is not a kernel."""
    starts = [0, 11, 30, 1300, 3000, 20000, 20012, 20030]
    acts = [_act("7", t, t + 10, "K") for t in starts]
    acts += [_act("9", 20, 40, "side"), _act("8", 0, 5000, "copy", kind="DtoH", nbytes=1 << 20)]
    acts.sort(key=lambda a: a["start"])
    rows = {r["bin"]: r for r in gp.idle_after_side_kernels(acts, "7")}
    assert (rows["no side kernel yet"]["boundaries"], rows["no side kernel yet"]["idle_us"]) \
        == (1, 1.0)
    assert (rows["during"]["boundaries"], rows["during"]["idle_us"]) == (1, 9.0)
    assert rows["1-10 ms after"]["boundaries"] == 2  # 1300 and 3000: long gaps, no idle
    assert rows["1-10 ms after"]["idle_us"] == 0.0
    far = rows[">= 100 ms after"]
    assert far["boundaries"] == 0 and far["per_boundary_us"] is None
    mid = rows["10-100 ms after"]  # 20,000, 20,012 and 20,030: 19.96-19.99 ms after
    assert (mid["boundaries"], mid["idle_us"], mid["per_boundary_us"]) == (3, 10.0, 10 / 3)
    assert [r["bin"] for r in gp.idle_after_side_kernels([], "")][:3] == [
        "no side kernel yet", "during", "0-1 ms after"]


def test_timeline_compare_script_reports_two_saved_waves(tmp_path):
    from script_loader import load_script

    tc = load_script("timeline_compare.py", "timeline_compare_script")
    acts = _acts()
    slow = [dict(x, start=x["start"] + 2.0, end=x["end"] + 2.0)
            if x["stream"] == "7" and x["start"] >= 10.5 else x for x in acts]
    pa, pb = str(tmp_path / "timeline-ion-noring.npz"), str(tmp_path / "timeline-ion.npz")
    gp.save_timeline(pa, acts, "7")
    gp.save_timeline(pb, slow, "7")
    out = tmp_path / "cmp.md"
    assert tc.main([pa, pb, "--window-ms", "0.1", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Compute-stream timelines: ion-noring (A) against ion (B)")
    # every kernel from 10.5 us on moved 2 us later: only the A -> B gap at 10 us grew
    assert "| A -> B | 2 | 2 | 5.5 | 7.5 | +2.0 |" in text
    assert "| B -> A | 1 | 1 | 3.0 | 3.0 | +0.0 |" in text
    assert "ion: the 10 0.1 ms windows with the most idle time" in text
    assert "| ion | " in text and "by the time since the last kernel on another stream" in text
