"""Where a compute stream's idle time sits, at every gap size: pure functions over the GPU
activities of ``stream_trace.gpu_activities`` (CPU-tested on synthetic traces), plus a
compact timeline to keep a profiled wave's kernels when the trace itself (hundreds of MB)
cannot come back from the GPU host.

The twenty-ninth session's profiled pair (``ion`` against ``ion-noring``, 300 decode
steps on an H100) put the ring's cost in the compute stream's idle time, 80 against
34 ms, with the kernels no slower, and almost none of it in gaps of 20 us or more: the
stream-level report (``stream_trace``) sees only those.  These functions look at all of
them:

* ``idle_intervals``: the gaps between the compute stream's busy stretches (kernels only,
  overlapping kernels merged), each with the kernels before and after it.
* ``gap_histogram``: count and summed length of those gaps by size bin.
* ``idle_near_side_work``: the compute span split into the time within ``near_us`` of
  other streams' work (kernels, and copies of 64 KiB or more) and the rest, with the idle
  time in each: whether the idle time sits beside a side stream's work (contention, a
  wait) or everywhere (a state of the device or of the process).
* ``window_idle``: the idle share of fixed windows of the span, as quantiles: spread thin
  over every window, or in bursts.
* ``gap_pairs``: the gaps below a size, by the pair of kernels around them: which
  boundary of the step grew; ``pair_deltas`` compares two configs' pairs, and
  ``top_idle_windows`` finds where idle time comes in bursts
  (``scripts/timeline_compare.py`` runs both on two saved timelines).
* ``idle_after_side_kernels``: the short idle time per kernel boundary by the time since
  the last side-stream kernel: a cost that stays after side kernels (the thirtieth
  session's reading) or one that sits beside them.
* ``timeline_arrays`` / ``save_timeline`` / ``load_timeline``: every compute kernel (start,
  duration, name index) and every side activity, as numpy arrays in one compressed file
  (~1 MB for 300 steps of a 28-layer model).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from ion_vllm.bench.stream_trace import idle_gaps

#: gap size bins (us): the lower edges; the last bin is open
GAP_EDGES_US = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 100.0, 1000.0)
#: gaps shorter than this (us) are float noise between back-to-back kernels (a trace's
#: time stamps resolve 1 ns), not gaps
MIN_GAP_US = 1e-3


def idle_intervals(acts: list[dict], stream: str) -> list[tuple[float, float, str, str]]:
    """The gaps between busy stretches of ``stream``'s kernels (``stream_trace.idle_gaps``
    at every size from ``MIN_GAP_US``): (start, end, the name of the kernel that ended last
    before the gap, the name of the kernel after it), in time order.  Overlapping kernels
    are one stretch; back-to-back kernels leave no gap (nor do kernels under
    ``MIN_GAP_US`` apart)."""
    return [(g0, g1, before["name"], after["name"])
            for g0, g1, before, after in idle_gaps(acts, stream, MIN_GAP_US)]


def _kernels(acts: list[dict], stream: str) -> list[dict]:
    """``stream``'s kernels, in the activities' (start) order."""
    return [a for a in acts if a["stream"] == stream and a["kind"] == "kernel"]


def gap_histogram(gaps: list[tuple], edges: tuple[float, ...] = GAP_EDGES_US) -> list[dict]:
    """Per size bin of ``edges`` (lower edges, us; the last bin open): ``lo``, ``hi`` (None
    for the last), ``count`` and ``us`` (summed length) of the gaps in it."""
    rows = [{"lo": lo, "hi": hi, "count": 0, "us": 0.0}
            for lo, hi in zip(edges, (*edges[1:], None))]
    for g in gaps:
        d = g[1] - g[0]
        i = max(0, bisect.bisect_right(edges, d) - 1)
        rows[i]["count"] += 1
        rows[i]["us"] += d
    return rows


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(a0: float, a1: float, union: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [a0, a1) covered by the sorted disjoint ``union`` (``starts``: its starts)."""
    i = max(0, bisect.bisect_right(starts, a0) - 1)
    tot = 0.0
    while i < len(union) and union[i][0] < a1:
        tot += max(0.0, min(a1, union[i][1]) - max(a0, union[i][0]))
        i += 1
    return tot


def _is_side_work(a: dict, stream: str, min_copy_bytes: int) -> bool:
    """Another stream's kernel, or its copy or set of at least ``min_copy_bytes``: the
    engine's own per-step copies (sampled tokens to the host: tens of bytes, twice a
    step) would put every moment of a decode wave near "side work"."""
    return a["stream"] != stream and (a["kind"] == "kernel" or a["bytes"] >= min_copy_bytes)


def idle_near_side_work(acts: list[dict], stream: str, near_us: float = 1000.0,
                        min_copy_bytes: int = 64 << 10,
                        gaps: list[tuple] | None = None) -> dict:
    """The compute span (first to last kernel of ``stream``) split into ``near`` (within
    ``near_us`` of side work, ``_is_side_work``: it runs, or ran or starts that close) and
    ``far``: ``span_us`` and ``idle_us`` of each, and ``idle_share`` = idle / span.  With
    no side work, all of the span is far.  ``gaps``: ``idle_intervals(acts, stream)`` when
    the caller has them already."""
    comp = _kernels(acts, stream)
    res = {"near_us": near_us}
    if not comp:
        for k in ("near", "far"):
            res[k] = {"span_us": 0.0, "idle_us": 0.0, "idle_share": 0.0}
        return res
    t0, t1 = comp[0]["start"], max(a["end"] for a in comp)
    zone = _union([(max(t0, a["start"] - near_us), min(t1, a["end"] + near_us))
                   for a in acts if _is_side_work(a, stream, min_copy_bytes)
                   and a["end"] + near_us > t0 and a["start"] - near_us < t1])
    starts = [s for s, _ in zone]
    near_span = sum(e - s for s, e in zone)
    gaps = idle_intervals(acts, stream) if gaps is None else gaps
    near_idle = sum(_overlap(g0, g1, zone, starts) for g0, g1, _, _ in gaps)
    idle = sum(g1 - g0 for g0, g1, _, _ in gaps)
    for k, span, idl in (("near", near_span, near_idle),
                         ("far", (t1 - t0) - near_span, idle - near_idle)):
        res[k] = {"span_us": span, "idle_us": idl, "idle_share": idl / span if span else 0.0}
    return res


def _idle_by_window(gaps: list[tuple], t0: float, window_us: float) -> dict[int, float]:
    """Idle us of each window ``i`` = [t0 + i * window_us, t0 + (i + 1) * window_us) that
    ``gaps`` reach (windows with none are absent)."""
    idle: dict[int, float] = defaultdict(float)
    for g0, g1, _, _ in gaps:
        i = int((g0 - t0) // window_us)
        while t0 + i * window_us < g1:
            w0 = t0 + i * window_us
            idle[i] += max(0.0, min(g1, w0 + window_us) - max(g0, w0))
            i += 1
    return idle


def window_idle(acts: list[dict], stream: str, window_us: float = 10_000.0,
                quantiles: tuple[float, ...] = (0.1, 0.5, 0.9, 0.99),
                gaps: list[tuple] | None = None) -> dict:
    """The compute span cut into windows of ``window_us`` (the last, partial one dropped
    when under half a window): ``windows``, and the quantiles of the windows' idle share
    (``q`` -> share): thin and everywhere (the median moves) or in bursts (only the top
    quantiles do).  ``gaps`` as in ``idle_near_side_work``."""
    comp = _kernels(acts, stream)
    if not comp:
        return {"window_us": window_us, "windows": 0, "quantiles": {}}
    t0, t1 = comp[0]["start"], max(a["end"] for a in comp)
    n = int((t1 - t0) // window_us)
    if (t1 - t0) - n * window_us >= window_us / 2:
        n += 1
    if n == 0:
        return {"window_us": window_us, "windows": 0, "quantiles": {}}
    per = _idle_by_window(idle_intervals(acts, stream) if gaps is None else gaps, t0,
                          window_us)
    idle = np.array([per.get(i, 0.0) for i in range(n)])
    span = np.full(n, window_us)
    span[-1] = min(window_us, t1 - (t0 + (n - 1) * window_us))
    share = idle / span
    return {"window_us": window_us, "windows": n,
            "quantiles": {str(q): float(np.quantile(share, q)) for q in quantiles}}


def gap_pairs(gaps: list[tuple], below_us: float = 20.0, top: int | None = 10,
              name_len: int = 48) -> list[dict]:
    """The gaps shorter than ``below_us`` by (kernel before, kernel after), names cut to
    ``name_len``: ``count``, ``us`` (summed) and ``mean_us``, most summed time first (the
    ``top`` first; None: all)."""
    by: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for g0, g1, before, after in gaps:
        d = g1 - g0
        if d < below_us:
            row = by[(before[:name_len], after[:name_len])]
            row[0] += 1
            row[1] += d
    rows = [{"before": k[0], "after": k[1], "count": v[0], "us": v[1], "mean_us": v[1] / v[0]}
            for k, v in by.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows if top is None else rows[:top]


def pair_deltas(a: list[tuple], b: list[tuple], below_us: float = 20.0, top: int = 10,
                name_len: int = 48) -> list[dict]:
    """Which kernel boundaries grew from gaps ``a`` to gaps ``b`` (``idle_intervals`` of
    two configs' waves): per (kernel before, kernel after) pair of the gaps under
    ``below_us``, ``count_a`` / ``count_b``, ``us_a`` / ``us_b`` and ``delta_us`` = us_b -
    us_a, the ``top`` largest |delta| first.  Equal work gives equal pair counts, so a
    pair whose time grew at an equal count is a boundary that got slower."""
    rows: dict[tuple[str, str], dict] = {}
    for side, gaps in (("a", a), ("b", b)):
        for r in gap_pairs(gaps, below_us, top=None, name_len=name_len):
            row = rows.setdefault((r["before"], r["after"]), {
                "before": r["before"], "after": r["after"], "count_a": 0, "count_b": 0,
                "us_a": 0.0, "us_b": 0.0})
            row[f"count_{side}"] = r["count"]
            row[f"us_{side}"] = r["us"]
    out = [{**r, "delta_us": r["us_b"] - r["us_a"]} for r in rows.values()]
    out.sort(key=lambda r: -abs(r["delta_us"]))
    return out[:top]


def top_idle_windows(acts: list[dict], stream: str, window_us: float = 10_000.0,
                     top: int = 10, gaps: list[tuple] | None = None) -> list[dict]:
    """The ``top`` windows of ``window_us`` with the most idle time: ``start_ms`` (from the
    stream's first kernel) and ``idle_us``, most idle first: where a burst sits (a wave's
    start waiting for loads, a preemption).  ``gaps`` as in ``idle_near_side_work``."""
    comp = _kernels(acts, stream)
    if not comp:
        return []
    idle = _idle_by_window(idle_intervals(acts, stream) if gaps is None else gaps,
                           comp[0]["start"], window_us)
    rows = [{"start_ms": i * window_us / 1e3, "idle_us": v} for i, v in idle.items()]
    rows.sort(key=lambda r: (-r["idle_us"], r["start_ms"]))
    return rows[:top]


#: ``idle_after_side_kernels`` bins: time since the last side-stream kernel ended (us)
SINCE_SIDE_EDGES_US = (0.0, 1_000.0, 10_000.0, 100_000.0)


def idle_after_side_kernels(acts: list[dict], stream: str, below_us: float = 20.0,
                            edges: tuple[float, ...] = SINCE_SIDE_EDGES_US,
                            gaps: list[tuple] | None = None) -> list[dict]:
    """The short idle time (gaps under ``below_us``) per kernel boundary of ``stream``, by
    where the boundary sits relative to other streams' kernels: ``"no side kernel yet"``
    (none has started), ``"during"`` (one is running), or the time since the last one ended
    (bins from ``edges``).  Each row: ``bin``, ``boundaries`` (compute kernels after the
    first), ``idle_us`` and ``per_boundary_us``.  It tells a cost that lasts (the same per
    boundary long after the last side kernel) from one that sits beside the side kernels.
    The thirtieth session's waves: ~0.57 us a boundary at every distance once a side kernel
    had run, against ~0.17-0.20 us in waves with none."""
    comp = _kernels(acts, stream)
    side = [a for a in acts if a["stream"] != stream and a["kind"] == "kernel"]
    gaps = idle_intervals(acts, stream) if gaps is None else gaps
    short = {g[1]: g[1] - g[0] for g in gaps if g[1] - g[0] < below_us}
    side_starts = [a["start"] for a in side]
    side_end_max = list(np.maximum.accumulate([a["end"] for a in side])) if side else []
    labels = ["no side kernel yet", "during"] + [
        f"{lo / 1e3:g}-{hi / 1e3:g} ms after" for lo, hi in zip(edges, edges[1:])] + [
        f">= {edges[-1] / 1e3:g} ms after"]
    rows = {lab: {"bin": lab, "boundaries": 0, "idle_us": 0.0} for lab in labels}
    for k in comp[1:]:
        t = k["start"]
        i = bisect.bisect_right(side_starts, t) - 1
        if i < 0:
            lab = labels[0]
        elif side_end_max[i] > t:
            lab = labels[1]
        else:
            j = bisect.bisect_right(edges, t - side_end_max[i]) - 1
            lab = labels[2 + j]
        rows[lab]["boundaries"] += 1
        rows[lab]["idle_us"] += short.get(t, 0.0)
    return [{**r, "per_boundary_us": r["idle_us"] / r["boundaries"] if r["boundaries"]
             else None} for r in rows.values()]


def summarize_gaps(acts: list[dict], stream: str, near_us: float = 1000.0,
                   window_us: float = 10_000.0, pair_below_us: float = 20.0,
                   gaps: list[tuple] | None = None) -> dict:
    """All of the above for one compute stream: ``histogram``, ``near_side``, ``windows``,
    ``pairs``, and ``idle_us`` (the gaps' sum).  ``gaps`` as in ``idle_near_side_work``."""
    gaps = idle_intervals(acts, stream) if gaps is None else gaps
    return {"idle_us": sum(g[1] - g[0] for g in gaps), "gaps": len(gaps),
            "histogram": gap_histogram(gaps),
            "near_side": idle_near_side_work(acts, stream, near_us, gaps=gaps),
            "windows": window_idle(acts, stream, window_us, gaps=gaps),
            "pairs": gap_pairs(gaps, pair_below_us)}


def timeline_arrays(acts: list[dict], stream: str) -> dict[str, np.ndarray]:
    """``stream``'s kernels and every other stream's activities as arrays, times in us from
    the first activity: ``k_start`` (float64), ``k_dur`` (float32), ``k_name`` (int32
    index into ``names``); ``s_start``, ``s_dur``, ``s_stream`` (int64), ``s_kind`` and
    ``s_bytes`` (int64); ``names`` and ``kinds`` (unicode arrays)."""
    t0 = acts[0]["start"] if acts else 0.0
    names: dict[str, int] = {}
    kinds: dict[str, int] = {}
    comp = _kernels(acts, stream)
    side = [a for a in acts if not (a["stream"] == stream and a["kind"] == "kernel")]

    def sid(s: str) -> int:
        try:
            return int(s)
        except ValueError:
            return -1

    return {
        "k_start": np.array([a["start"] - t0 for a in comp], dtype=np.float64),
        "k_dur": np.array([a["end"] - a["start"] for a in comp], dtype=np.float32),
        "k_name": np.array([names.setdefault(a["name"], len(names)) for a in comp],
                           dtype=np.int32),
        "s_start": np.array([a["start"] - t0 for a in side], dtype=np.float64),
        "s_dur": np.array([a["end"] - a["start"] for a in side], dtype=np.float32),
        "s_stream": np.array([sid(a["stream"]) for a in side], dtype=np.int64),
        "s_kind": np.array([kinds.setdefault(a["kind"], len(kinds)) for a in side],
                           dtype=np.int32),
        "s_bytes": np.array([a["bytes"] for a in side], dtype=np.int64),
        "names": np.array(list(names), dtype=str),
        "kinds": np.array(list(kinds), dtype=str),
        "stream": np.array([sid(stream)], dtype=np.int64),
    }


def save_timeline(path: str, acts: list[dict], stream: str) -> None:
    """``timeline_arrays`` into one compressed ``.npz`` at ``path``."""
    np.savez_compressed(path, **timeline_arrays(acts, stream))


def load_timeline(path: str) -> list[dict]:
    """The activities of a ``save_timeline`` file back in ``gpu_activities`` form (times
    from the first activity; ``corr`` None), sorted by start: the functions above run on
    them as on a trace's."""
    z = np.load(path)
    cs = str(int(z["stream"][0]))
    names, kinds = [str(x) for x in z["names"]], [str(x) for x in z["kinds"]]
    out = [{"stream": cs, "start": float(s), "end": float(s) + float(d), "kind": "kernel",
            "name": names[i], "bytes": 0, "corr": None}
           for s, d, i in zip(z["k_start"], z["k_dur"], z["k_name"])]
    out += [{"stream": str(int(st)), "start": float(s), "end": float(s) + float(d),
             "kind": kinds[k], "name": kinds[k], "bytes": int(b), "corr": None}
            for s, d, st, k, b in zip(z["s_start"], z["s_dur"], z["s_stream"], z["s_kind"],
                                      z["s_bytes"])]
    out.sort(key=lambda a: a["start"])
    return out


def markdown_lines(rows: list[tuple[str, dict]]) -> list[str]:
    """Tables of ``summarize_gaps`` results, one row per (label, summary): idle time by gap
    size; near and far from side work, with the windows' idle-share quantiles; the top
    kernel pairs around short gaps."""
    if not rows:
        return []
    hist0 = rows[0][1]["histogram"]
    bins = [f"{h['lo']:g}-{h['hi']:g}" if h["hi"] is not None else f">={h['lo']:g}"
            for h in hist0]
    out = ["", "Compute-stream idle time by gap size (us bins; ms, with counts):", "",
           "| config | idle ms | " + " | ".join(bins) + " |",
           "|---|---|" + "---|" * len(bins)]
    for label, g in rows:
        out.append(f"| {label} | {g['idle_us'] / 1e3:.1f} | " + " | ".join(
            f"{h['us'] / 1e3:.1f} ({h['count']})" for h in g["histogram"]) + " |")
    q = list(rows[0][1]["windows"]["quantiles"])
    ns = rows[0][1]["near_side"]["near_us"]
    out += ["", f"The same idle time near other streams' work (kernels, copies of 64 KiB or "
            f"more; within {ns:g} us of it) and "
            f"far from it, and the idle share of {rows[0][1]['windows']['window_us'] / 1e3:g}"
            " ms windows by quantile:", "",
            "| config | near: span ms, idle ms (share) | far: span ms, idle ms (share) | "
            + " | ".join(f"window q{x}" for x in q) + " |",
            "|---|---|---|" + "---|" * len(q)]
    for label, g in rows:
        n, f = g["near_side"]["near"], g["near_side"]["far"]
        wq = g["windows"]["quantiles"]
        out.append(f"| {label} | {n['span_us'] / 1e3:.1f}, {n['idle_us'] / 1e3:.1f} "
                   f"({n['idle_share']:.4f}) | {f['span_us'] / 1e3:.1f}, "
                   f"{f['idle_us'] / 1e3:.1f} ({f['idle_share']:.4f}) | "
                   + " | ".join(f"{wq.get(x, 0.0):.4f}" for x in q) + " |")
    out += ["", "Short gaps (under 20 us) by the kernels around them, the three largest "
            "sums (ms, count, mean us):", "", "| config | before -> after: ms, count, mean |",
            "|---|---|"]
    for label, g in rows:
        out.append(f"| {label} | " + "; ".join(
            f"{p['before'][:28]} -> {p['after'][:28]}: {p['us'] / 1e3:.2f}, {p['count']}, "
            f"{p['mean_us']:.2f}" for p in g["pairs"][:3]) + " |")
    return out
