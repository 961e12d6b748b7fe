"""GPU activity of a torch-profiler (Kineto) trace, by CUDA stream: where a step's time
goes when a side stream (a KV tier's copies and gathers) runs beside the forward pass.

Pure functions over a loaded Chrome trace (``load_trace``); no GPU needed, so CPU tests
check them on synthetic traces.

* ``gpu_activities``: every GPU kernel, memcpy and memset with its stream, interval, kind
  (``kernel``, ``HtoD``, ``DtoH``, ``DtoD``, ``memcpy``, ``memset``), name and bytes.
* ``stream_table``: per stream, the count, summed time and busy time (union) of each kind,
  and the bytes of each copy direction.
* ``compute_stream``: the stream with the most kernel time (the forward pass).
* ``busy_stats``: span, union busy time and long gaps of a set of intervals.
* ``overlap_slowdown``: for the compute stream's heaviest kernels, the mean duration of the
  launches that overlapped any other stream's activity against those that did not: a
  contention signal (SMs, HBM, PCIe) that the host's timing cannot see.
* ``host_waits``: each idle gap of the compute stream, split by who made it: the host (the
  launch of the work after the gap was issued after the stream went idle) or the device
  (it was issued before: a wait on another stream, a copy queue or a graph's own
  dependency); and what the host was doing, by CPU event name, during the host's part.
* ``gaps_near_side_work``: the same gaps, by which other stream's work (stream and kind)
  ran during the gap or started shortly before it: whether the forward pass's idle time
  sits beside a side stream's pieces (a KV tier's gathers, id copies, drains) or apart
  from them.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict

ACTIVITY_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # host API calls; args.correlation -> GPU work
HOST_CATS = LAUNCH_CATS + ("user_annotation", "cpu_op")
ION_PREFIX = "ion_kv:"  # the KV tier's ranges (ion_vllm.kv_tier.trace_ranges.traced)


def load_trace(path: str) -> dict:
    """A Chrome trace (plain or gzipped JSON) as a dict with a ``traceEvents`` list."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return {"traceEvents": data} if isinstance(data, list) else data


def busy_stats(intervals: list[tuple[float, float]], gap_us: float = 100.0) -> dict:
    """How busy a set of (start, end) intervals (us) keeps the GPU: ``span_us`` (first start
    to last end), ``busy_us`` (their union, so overlapping intervals count once),
    ``idle_us`` = span - busy, ``busy_share``, and the gaps of at least ``gap_us`` between
    busy stretches (``long_gaps``, ``long_gap_us``): waits for the host or for a
    dependency rather than back-to-back launches."""
    if not intervals:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "busy_share": 0.0,
                "long_gaps": 0, "long_gap_us": 0.0, "gap_threshold_us": gap_us}
    iv = sorted(intervals)
    busy, long_gaps, long_gap_us = 0.0, 0, 0.0
    cur_s, cur_e = iv[0]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            if s - cur_e >= gap_us:
                long_gaps += 1
                long_gap_us += s - cur_e
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e in iv) - iv[0][0]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "busy_share": busy / span if span else 0.0, "long_gaps": long_gaps,
            "long_gap_us": long_gap_us, "gap_threshold_us": gap_us}


def _kind(cat: str, name: str) -> str:
    if cat == "kernel":
        return "kernel"
    if cat == "gpu_memset":
        return "memset"
    m = re.search(r"\b(HtoD|DtoH|DtoD|PtoP)\b", name)
    return m.group(1) if m else "memcpy"


def gpu_activities(trace: dict) -> list[dict]:
    """Every complete GPU activity event: ``stream`` (the event's ``args.stream``, else its
    ``tid``), ``start`` / ``end`` (us), ``kind``, ``name`` and ``bytes`` (copies and sets;
    0 when the trace has none), sorted by start."""
    out = []
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat")
        if cat not in ACTIVITY_CATS or ev.get("ph", "X") != "X":
            continue
        if "dur" not in ev or "ts" not in ev:
            continue
        args = ev.get("args") or {}
        name = str(ev.get("name", ""))
        t0 = float(ev["ts"])
        out.append({"stream": str(args.get("stream", ev.get("tid", "?"))), "start": t0,
                    "end": t0 + float(ev["dur"]), "kind": _kind(cat, name), "name": name,
                    "bytes": int(args.get("bytes", 0) or 0),
                    "corr": args.get("correlation")})
    out.sort(key=lambda a: a["start"])
    return out


def compute_stream(acts: list[dict]) -> str | None:
    """The stream with the most kernel time (the forward pass's), or None."""
    per: dict[str, float] = defaultdict(float)
    for a in acts:
        if a["kind"] == "kernel":
            per[a["stream"]] += a["end"] - a["start"]
    return max(per, key=per.get) if per else None


def stream_table(acts: list[dict]) -> list[dict]:
    """Per stream (most active first): ``stream``, ``total_us`` (summed durations),
    ``busy_us`` (union), and per kind ``<kind>_count`` / ``<kind>_us``, plus
    ``<dir>_bytes`` for each copy direction present."""
    by: dict[str, list[dict]] = defaultdict(list)
    for a in acts:
        by[a["stream"]].append(a)
    rows = []
    for s, lst in by.items():
        row: dict = {"stream": s, "total_us": sum(a["end"] - a["start"] for a in lst),
                     "busy_us": busy_stats([(a["start"], a["end"]) for a in lst])["busy_us"]}
        for a in lst:
            k = a["kind"]
            row[f"{k}_count"] = row.get(f"{k}_count", 0) + 1
            row[f"{k}_us"] = row.get(f"{k}_us", 0.0) + a["end"] - a["start"]
            if k not in ("kernel",):
                row[f"{k}_bytes"] = row.get(f"{k}_bytes", 0) + a["bytes"]
        rows.append(row)
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def overlap_slowdown(acts: list[dict], stream: str, top: int = 8) -> list[dict]:
    """For the ``top`` kernels by total time on ``stream``: launches and mean duration
    (us) when the launch overlapped any activity of another stream (``busy``) and when it
    did not (``alone``), and their ratio.  A kernel slowed by work beside it (SMs taken,
    HBM or PCIe shared) shows a ratio above 1."""
    others = sorted((a["start"], a["end"]) for a in acts if a["stream"] != stream)
    # merged intervals of every other stream, for an O(log n) overlap test
    merged: list[list[float]] = []
    for s, e in others:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    starts = [m[0] for m in merged]

    def overlaps(s: float, e: float) -> bool:
        i = bisect.bisect_left(starts, e) - 1  # last merged interval starting before e
        return i >= 0 and merged[i][1] > s

    per: dict[str, dict] = {}
    for a in acts:
        if a["stream"] != stream or a["kind"] != "kernel":
            continue
        d = a["end"] - a["start"]
        row = per.setdefault(a["name"], {"total_us": 0.0, "busy": [0, 0.0], "alone": [0, 0.0]})
        row["total_us"] += d
        side = row["busy" if overlaps(a["start"], a["end"]) else "alone"]
        side[0] += 1
        side[1] += d
    out = []
    for name, r in sorted(per.items(), key=lambda kv: -kv[1]["total_us"])[:top]:
        nb, tb = r["busy"]
        na, ta = r["alone"]
        mb = tb / nb if nb else None
        ma = ta / na if na else None
        out.append({"kernel": name[:80], "total_us": r["total_us"],
                    "busy_count": nb, "busy_mean_us": mb, "alone_count": na,
                    "alone_mean_us": ma, "ratio": (mb / ma) if mb and ma else None})
    return out


def host_events(trace: dict) -> list[dict]:
    """Complete host-side events (API calls, user annotations, CPU ops): ``cat``, ``name``,
    ``tid``, ``start`` / ``end`` (us) and ``corr`` (API calls' correlation id), by start."""
    out = []
    for ev in trace.get("traceEvents", []):
        cat = ev.get("cat")
        if cat not in HOST_CATS or ev.get("ph", "X") != "X" or "dur" not in ev:
            continue
        t0 = float(ev["ts"])
        out.append({"cat": cat, "name": str(ev.get("name", "")), "tid": ev.get("tid"),
                    "start": t0, "end": t0 + float(ev["dur"]),
                    "corr": (ev.get("args") or {}).get("correlation")})
    out.sort(key=lambda e: e["start"])
    return out


def _top(table: dict, top: int) -> list[dict]:
    rows = [{"cat": c, "name": n[:80], "count": v[0], "us": v[1]}
            for (c, n), v in table.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def idle_gaps(acts: list[dict], stream: str, gap_us: float):
    """The idle gaps of at least ``gap_us`` between kernels of ``stream``: (gap start, gap
    end, the kernel that ended last before the gap, the kernel after it), in time order.
    Overlapping kernels are one busy stretch.  The one gap walk of the trace reports
    (``host_waits``, ``gaps_near_side_work``, ``gap_profile.idle_intervals``)."""
    cur_end = None
    last = None
    for a in acts:
        if a["stream"] != stream or a["kind"] != "kernel":
            continue
        if cur_end is not None and a["start"] - cur_end >= gap_us:
            yield cur_end, a["start"], last, a
        if cur_end is None or a["end"] >= cur_end:
            cur_end, last = a["end"], a


def host_waits(acts: list[dict], hosts: list[dict], stream: str, gap_us: float = 20.0,
               top: int = 12) -> dict:
    """The idle gaps of at least ``gap_us`` between kernels of ``stream``, each split by who
    made it.  The work after a gap was launched by a host API call (its correlation id):
    * issued after the stream went idle: the host was late by ``min(launch, gap end) -
      gap start`` (``host_late_us``); the rest of the gap is the launch's own latency;
    * issued before: the device held it back (``device_us``): a wait on another stream's
      event, a copy queue, or a dependency inside one graph launch;
    * no launch found (``unknown_us``).
    ``during_host_late``: the host events (by category and name) overlapping the host-late
    windows, with their overlap time; nested events each count.  ``api_calls``: every API
    call name by summed duration over the trace; ``annotations``: every user annotation
    name likewise (count, summed us), the top ``top`` of each; ``ion_ranges``: every
    annotation of the Ion KV tier's entry points (``ion_vllm.kv_tier.trace_ranges``)."""
    launch = {e["corr"]: e for e in hosts if e["cat"] in LAUNCH_CATS and e["corr"] is not None}
    res = {"gap_threshold_us": gap_us, "gaps": 0, "gap_us": 0.0, "host_late": 0,
           "host_late_us": 0.0, "device": 0, "device_us": 0.0, "unknown": 0,
           "unknown_us": 0.0}
    windows: list[tuple[float, float]] = []
    for g0, g1, _, a in idle_gaps(acts, stream, gap_us):
        res["gaps"] += 1
        res["gap_us"] += g1 - g0
        ln = launch.get(a["corr"])
        if ln is None:
            res["unknown"] += 1
            res["unknown_us"] += g1 - g0
        elif ln["start"] > g0:
            late_end = min(ln["start"], g1)
            res["host_late"] += 1
            res["host_late_us"] += late_end - g0
            res["device_us"] += g1 - late_end
            windows.append((g0, late_end))
        else:
            res["device"] += 1
            res["device_us"] += g1 - g0
    during: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    w_starts = [w[0] for w in windows]
    api: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    ann: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    for e in hosts:
        table = (api if e["cat"] in LAUNCH_CATS else
                 ann if e["cat"] == "user_annotation" else None)
        if table is not None:
            row = table[(e["cat"], e["name"])]
            row[0] += 1
            row[1] += e["end"] - e["start"]
        i = max(0, bisect.bisect_right(w_starts, e["start"]) - 1)
        hit = False
        while i < len(windows) and windows[i][0] < e["end"]:
            ov = min(e["end"], windows[i][1]) - max(e["start"], windows[i][0])
            if ov > 0:
                during[(e["cat"], e["name"])][1] += ov
                hit = True
            i += 1
        if hit:
            during[(e["cat"], e["name"])][0] += 1
    res["during_host_late"] = _top(during, top)
    res["api_calls"] = _top(api, top)
    res["annotations"] = _top(ann, top)
    res["ion_ranges"] = [r for r in _top(ann, len(ann)) if r["name"].startswith(ION_PREFIX)]
    return res


def gaps_near_side_work(acts: list[dict], stream: str, gap_us: float = 20.0,
                        lead_us: float = 100.0) -> dict:
    """The idle gaps of at least ``gap_us`` between kernels of ``stream`` (as in
    ``host_waits``), each matched with the other streams' activities that overlap the
    window from ``lead_us`` before the gap to its end.  ``by_side``: per (stream, kind) of
    side work, the gaps it was near and their summed length (a gap near several counts
    for each) and ``pieces``, how many such activities there were in all (so that "near N
    gaps" reads against "of M pieces"), most gap time first; ``alone`` / ``alone_us``: the
    gaps with no side work near."""
    side = sorted((a for a in acts if a["stream"] != stream), key=lambda a: a["start"])
    starts = [a["start"] for a in side]
    by: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0])
    pieces: dict[tuple[str, str], int] = defaultdict(int)
    for a in side:
        pieces[(a["stream"], a["kind"])] += 1
    max_len = max((a["end"] - a["start"] for a in side), default=0.0)
    res = {"gap_threshold_us": gap_us, "lead_us": lead_us, "gaps": 0, "gap_us": 0.0,
           "alone": 0, "alone_us": 0.0}
    for g0, g1, _, _ in idle_gaps(acts, stream, gap_us):
        res["gaps"] += 1
        res["gap_us"] += g1 - g0
        w0 = g0 - lead_us
        near = set()
        # side work overlapping [w0, g1): it starts before g1 and ends after w0
        i = bisect.bisect_left(starts, w0 - max_len)
        while i < len(side) and side[i]["start"] < g1:
            if side[i]["end"] > w0:
                near.add((side[i]["stream"], side[i]["kind"]))
            i += 1
        for k in near:
            by[k][0] += 1
            by[k][1] += g1 - g0
        if not near:
            res["alone"] += 1
            res["alone_us"] += g1 - g0
    res["by_side"] = [{"stream": k[0], "kind": k[1], "gaps": v[0], "gap_us": v[1],
                       "pieces": pieces[k]}
                      for k, v in sorted(by.items(), key=lambda kv: -kv[1][1])]
    return res


def summarize(trace: dict, gap_us: float = 100.0, top: int = 8,
              host_gap_us: float = 20.0, acts: list[dict] | None = None) -> dict:
    """The whole report of one trace: the compute stream, its busy/gap stats over its own
    span, every stream's table, the compute kernels' overlap slowdown, and the split of
    its idle gaps of ``host_gap_us`` or more between host and device (``host_waits``) and
    by the side work near them (``gaps_near_side_work``).  ``acts``: the trace's
    ``gpu_activities`` when the caller has them already."""
    acts = gpu_activities(trace) if acts is None else acts
    cs = compute_stream(acts)
    comp = [(a["start"], a["end"]) for a in acts if a["stream"] == cs and a["kind"] == "kernel"]
    return {"compute_stream": cs, "activities": len(acts),
            "compute": busy_stats(comp, gap_us),
            "streams": stream_table(acts),
            "overlap": overlap_slowdown(acts, cs, top) if cs is not None else [],
            "host": (host_waits(acts, host_events(trace), cs, host_gap_us)
                     if cs is not None else None),
            "side": (gaps_near_side_work(acts, cs, host_gap_us)
                     if cs is not None else None)}
