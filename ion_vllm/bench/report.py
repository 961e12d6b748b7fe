"""Result storage (summary.json), merging, markdown table and matplotlib plot.

``summary.json`` layout::

    {"ceilings": {"copy_gbps": ..., "gemm_tflops": ..., "gpu": ..., "date": ...,
                  "versions": {...}},
     "records": [{"suite": "kernel"|"e2e", "case": ..., "backend": ..., ...}, ...]}

One record per (suite, case, backend); re-running a subset replaces the matching
records and keeps the others.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import statistics
from pathlib import Path

KERNEL_ORDER = ("ion", "ion-auto", "ion-auto-rc", "ion-auto-gc", "ion-auto-p128",
                "ion-auto-lr", "ion-auto-pdl", "ion-auto-lc", "ion-auto-kp", "ion-auto-append",
                "ion-auto-fused", "ion-auto-fused-kp", "ion-auto-s2", "ion-auto-fused-s2",
                "ion-auto-fused-wf", "ion-auto-pp", "ion-auto-fused-pp", "ion-auto-np",
                "ion-auto-fused-np", "ion-auto-pin", "ion-auto-fused-pin", "ion-unpacked", "ion-m128", "ion-m128-unpacked", "fa3",
                "fa4", "triton")
E2E_ORDER = ("ION", "ION+packed", "ION+m64", "ION+rowcomb", "ION+groupcomb", "ION+p128",
             "ION+lazy", "ION+pin", "ION+noreuse", "ION+repage", "ION+vs", "ION+novs", "ION+vsauto", "ION+si", "ION+vs+si", "ION+kp", "ION+pdl", "ION+append", "ION+append+rowcomb", "ION+lanes",
             "ION+unpacked", "ION+fused", "ION+fused+unpacked", "ION+lanes+fused",
             "FLASH_ATTN")
KERNEL_BASELINE = "fa3"
E2E_BASELINE = "FLASH_ATTN"
ION_KERNEL = "ion"
ION_E2E = "ION"


# --------------------------------------------------------------------------- paths

def slugify(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "-", name.strip()).strip("-").lower()
    return s or "unknown-gpu"


def today() -> str:
    return _dt.date.today().isoformat()


def default_results_dir(gpu_name: str, date: str | None = None,
                        root: str | os.PathLike | None = None) -> Path:
    root = Path(root) if root is not None else Path("bench") / "results"
    return root / f"{date or today()}-{slugify(gpu_name)}"


# --------------------------------------------------------------------------- summary io

def empty_summary() -> dict:
    return {"ceilings": {}, "records": []}


def load_summary(path: str | os.PathLike) -> dict:
    """Load ``summary.json`` from a directory or file path; empty if absent.
    A bare top-level list (records only, ceilings as a record with suite
    "ceilings") is accepted too."""
    p = Path(path)
    if p.suffix != ".json":
        p = p / "summary.json"
    if not p.exists():
        return empty_summary()
    data = json.loads(p.read_text())
    if isinstance(data, list):
        ceil = next((r for r in data if r.get("suite") == "ceilings"), {})
        recs = [r for r in data if r.get("suite") != "ceilings"]
        return {"ceilings": {k: v for k, v in ceil.items() if k != "suite"}, "records": recs}
    data.setdefault("ceilings", {})
    data.setdefault("records", [])
    return data


def record_key(rec: dict) -> tuple:
    return (rec.get("suite"), rec.get("case"), rec.get("backend"))


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """Replace records of ``old`` whose (suite, case, backend) appears in ``new``
    (in place, keeping order); append the rest of ``new`` in order."""
    new_by_key: dict[tuple, dict] = {}
    for r in new:
        new_by_key[record_key(r)] = r
    out = []
    used = set()
    for r in old:
        k = record_key(r)
        if k in new_by_key:
            if k not in used:
                out.append(new_by_key[k])
                used.add(k)
        else:
            out.append(r)
    for r in new:
        k = record_key(r)
        if k not in used:
            out.append(new_by_key[k])
            used.add(k)
    return out


def merge_ceilings(old: dict, new: dict) -> dict:
    """Newer non-None values win; versions dicts are merged."""
    out = dict(old)
    for k, v in new.items():
        if v is None:
            continue
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            merged = dict(out[k])
            merged.update({kk: vv for kk, vv in v.items() if vv is not None})
            out[k] = merged
        else:
            out[k] = v
    return out


def merge_summary(summary: dict, records: list[dict], ceilings: dict | None = None) -> dict:
    return {"ceilings": merge_ceilings(summary.get("ceilings", {}), ceilings or {}),
            "records": merge_records(summary.get("records", []), records)}


def save_summary(directory: str | os.PathLike, summary: dict) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = d / "summary.json"
    tmp = d / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=False, default=_json_default) + "\n")
    os.replace(tmp, p)
    return p


def update_summary(directory: str | os.PathLike, records: list[dict],
                   ceilings: dict | None = None) -> dict:
    """Load, merge ``records``/``ceilings`` in, save; returns the merged summary."""
    merged = merge_summary(load_summary(directory), records, ceilings)
    save_summary(directory, merged)
    return merged


def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.integer):
            return int(o)
        if isinstance(o, np.floating):
            return float(o)
    except ImportError:  # pragma: no cover
        pass
    return str(o)


# --------------------------------------------------------------------------- e2e stats

def e2e_aggregate(runs: list[dict]) -> dict:
    """Mean/min/max of total and output tok/s over repeats."""
    out: dict = {"repeats": len(runs)}
    for key in ("total_tok_s", "output_tok_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        if vals:
            out[key] = statistics.fmean(vals)
            out[key + "_min"] = min(vals)
            out[key + "_max"] = max(vals)
        else:
            out[key] = None
    return out


def e2e_ratio(ion: dict, base: dict, key: str = "total_tok_s") -> dict | None:
    """ION/baseline ratio of the means, with the per-repeat ratios' spread, mean and
    sample standard deviation (None for one pair) (repeat i of ION paired with repeat i
    of the baseline: runs were interleaved)."""
    a = [r.get(key) for r in ion.get("runs", [])]
    b = [r.get(key) for r in base.get("runs", [])]
    pairs = [(x, y) for x, y in zip(a, b) if x and y]
    if not pairs or not ion.get(key) or not base.get(key):
        return None
    rs = [x / y for x, y in pairs]
    return {"ratio": ion[key] / base[key], "ratio_min": min(rs), "ratio_max": max(rs),
            "ratio_mean": statistics.fmean(rs),
            "ratio_sd": statistics.stdev(rs) if len(rs) > 1 else None, "pairs": len(rs)}


# --------------------------------------------------------------------------- table

def _order(names, preferred):
    names = list(dict.fromkeys(names))
    return [n for n in preferred if n in names] + sorted(n for n in names if n not in preferred)


def _ok(rec: dict | None) -> bool:
    return bool(rec) and rec.get("status", "ok") == "ok" and rec.get("median_us") is not None


def _fmt_frac(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _kernel_cell(rec: dict | None) -> str:
    if rec is None:
        return ""
    if not _ok(rec):
        return rec.get("status", "n/a")
    s = f"{rec['median_us']:.1f}"
    parts = []
    if rec.get("frac_copy_bw") is not None:
        parts.append(f"bw {rec['frac_copy_bw']:.2f}")
    if rec.get("frac_gemm") is not None:
        parts.append(f"mma {rec['frac_gemm']:.2f}")
    return s + (f" ({', '.join(parts)})" if parts else "")


def kernel_speedup(ion: dict | None, base: dict | None) -> float | None:
    if _ok(ion) and _ok(base):
        return base["median_us"] / ion["median_us"]
    return None


def _kernel_table(recs: list[dict]) -> list[str]:
    cases = list(dict.fromkeys(r["case"] for r in recs))
    backends = _order([r["backend"] for r in recs], KERNEL_ORDER)
    by = {(r["case"], r["backend"]): r for r in recs}
    # one speed-up column per ION variant in the run (ion, ion-auto, ...), FA3 µs / its µs
    ions = [b for b in backends if b.startswith(ION_KERNEL)] or [ION_KERNEL]
    head = (["case"] + [f"{b} µs (frac)" for b in backends]
            + [f"{b}/FA3" if len(ions) > 1 else "ION/FA3" for b in ions])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        row = [c] + [_kernel_cell(by.get((c, b))) for b in backends]
        for b in ions:
            sp = kernel_speedup(by.get((c, b)), by.get((c, KERNEL_BASELINE)))
            row.append("–" if sp is None else f"{sp:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    errs = [r for r in recs if not _ok(r) and r.get("error")]
    if errs:
        lines.append("")
        lines.append("Not measured:")
        seen = set()
        for r in errs:
            msg = str(r["error"]).splitlines()[0][:200]
            key = (r["backend"], msg) if r.get("status") == "skipped" else (r["case"], r["backend"])
            if key in seen:
                continue
            seen.add(key)
            where = r["backend"] if r.get("status") == "skipped" else f"{r['case']} / {r['backend']}"
            lines.append(f"- {where}: {r.get('status')}: {msg}")
    return lines


def _spread(rec: dict, key: str) -> str:
    if rec is None or rec.get(key) is None:
        return rec.get("status", "–") if rec else ""
    lo, hi = rec.get(key + "_min"), rec.get(key + "_max")
    if lo is None or hi is None:
        return f"{rec[key]:.0f}"
    return f"{rec[key]:.0f} ({lo:.0f}–{hi:.0f})"


def _e2e_table(recs: list[dict]) -> list[str]:
    cases = list(dict.fromkeys(r["case"] for r in recs))
    backends = _order([r["backend"] for r in recs], E2E_ORDER)
    by = {(r["case"], r["backend"]): r for r in recs}
    ions = [b for b in backends if b.startswith(ION_E2E)] or [ION_E2E]
    short = {b: b.replace("FLASH_ATTN", "FA") for b in ions}
    head = (["workload", "repeats"] + [f"{b} total tok/s" for b in backends]
            + [f"{short[b]}/FA total" for b in ions]
            + [f"{b} output tok/s" for b in backends]
            + [f"{short[b]}/FA output" for b in ions])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cases:
        reps = sorted({str(by[(c, b)].get("repeats", "")) for b in backends if (c, b) in by})
        row = [c, "/".join(reps)]
        row += [_spread(by.get((c, b)), "total_tok_s") for b in backends]
        row += [_ratio_cell(by.get((c, b)), by.get((c, E2E_BASELINE)), "total_tok_s")
                for b in ions]
        row += [_spread(by.get((c, b)), "output_tok_s") for b in backends]
        row += [_ratio_cell(by.get((c, b)), by.get((c, E2E_BASELINE)), "output_tok_s")
                for b in ions]
        lines.append("| " + " | ".join(row) + " |")
    lat = [r for r in recs if r.get("ttft_p50_ms") is not None]
    if lat:
        lines += ["", "| workload | backend | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
                  "|---|---|---|---|---|---|"]
        for r in lat:
            cells = [r["case"], r["backend"]] + [
                "–" if r.get(k) is None else f"{r[k]:.1f}"
                for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")]
            lines.append("| " + " | ".join(cells) + " |")
    errs = [r for r in recs if r.get("status", "ok") != "ok"]
    if errs:
        lines += ["", "Not measured:"]
        for r in errs:
            lines.append(f"- {r['case']} / {r['backend']}: {r.get('status')}: "
                         f"{str(r.get('error', '')).splitlines()[0][:200] if r.get('error') else ''}")
    return lines


def _ratio_cell(ion, base, key) -> str:
    if not ion or not base:
        return "–"
    r = e2e_ratio(ion, base, key)
    if r is None:
        return "–"
    return f"{r['ratio']:.3f} ({r['ratio_min']:.3f}–{r['ratio_max']:.3f})"


def render_table(summary: dict) -> str:
    c = summary.get("ceilings", {})
    lines = ["# ION vs stock vLLM attention", ""]
    meta = []
    for k in ("gpu", "date"):
        if c.get(k):
            meta.append(f"{k}: {c[k]}")
    if c.get("copy_gbps"):
        meta.append(f"copy ceiling: {c['copy_gbps']:.0f} GB/s")
    if c.get("gemm_tflops"):
        meta.append(f"bf16 GEMM ceiling: {c['gemm_tflops']:.0f} TFLOP/s")
    if c.get("versions"):
        meta.append("versions: " + ", ".join(f"{k} {v}" for k, v in c["versions"].items() if v))
    if meta:
        lines += ["- " + m for m in meta] + [""]
    krecs = [r for r in summary.get("records", []) if r.get("suite") == "kernel"]
    erecs = [r for r in summary.get("records", []) if r.get("suite") == "e2e"]
    if krecs:
        lines += ["## Kernel (median µs; frac = share of the copy-bandwidth / GEMM ceiling; "
                  "ION/FA3 = FA3 µs / ION µs)", ""]
        timings = sorted({r["timing"] for r in krecs if r.get("timing")})
        if timings:
            lines += [f"Timing: {', '.join(timings)} (`ion-bench kernel --timing`; "
                      "interleaved: a case's backends alternate call by call in one "
                      "stream).", ""]
        lines += _kernel_table(krecs) + [""]
    if erecs:
        # serve-mode cases are named "<workload>-serve" (e2e.run_serve*)
        serve = any(str(r.get("case", "")).endswith("-serve") for r in erecs)
        thr = any(not str(r.get("case", "")).endswith("-serve") for r in erecs)
        tools = " and ".join(t for t, on in (("`vllm bench throughput`", thr),
                                              ("`vllm bench serve` against `vllm serve`", serve))
                             if on)
        lines += [f"## End to end ({tools}; mean (min–max) over repeats; "
                  "ratio = ION mean / FLASH_ATTN mean (spread of per-repeat ratios))", ""]
        lines += _e2e_table(erecs) + [""]
    if not krecs and not erecs:
        lines.append("(no records)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plot

def render_plot(summary: dict, path: str | os.PathLike) -> Path | None:
    """Grouped bars per case: speed relative to FA3 (kernel: FA3 µs / backend µs)
    and to FLASH_ATTN (e2e: total tok/s ratio, whiskers = per-repeat spread)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = summary.get("records", [])
    panels = []
    krecs = [r for r in recs if r.get("suite") == "kernel"]
    if krecs:
        by = {(r["case"], r["backend"]): r for r in krecs}
        cases = [c for c in dict.fromkeys(r["case"] for r in krecs)
                 if _ok(by.get((c, KERNEL_BASELINE)))]
        backends = _order([r["backend"] for r in krecs], KERNEL_ORDER)
        series = {}
        for b in backends:
            vals = []
            for c in cases:
                r = by.get((c, b))
                vals.append(by[(c, KERNEL_BASELINE)]["median_us"] / r["median_us"]
                            if _ok(r) else math.nan)
            if any(not math.isnan(v) for v in vals):
                series[b] = (vals, None)
        if cases:
            panels.append(("Kernel: speed relative to FA3 (FA3 µs / backend µs; higher is faster)",
                           cases, series))
    erecs = [r for r in recs if r.get("suite") == "e2e"]
    if erecs:
        by = {(r["case"], r["backend"]): r for r in erecs}
        cases = [c for c in dict.fromkeys(r["case"] for r in erecs)
                 if (by.get((c, E2E_BASELINE)) or {}).get("total_tok_s")]
        backends = _order([r["backend"] for r in erecs], E2E_ORDER)
        series = {}
        for b in backends:
            vals, lo, hi = [], [], []
            for c in cases:
                r = by.get((c, b))
                rat = e2e_ratio(r, by[(c, E2E_BASELINE)]) if r and r.get("total_tok_s") else None
                if rat is None:
                    vals.append(math.nan)
                    lo.append(0.0)
                    hi.append(0.0)
                else:
                    vals.append(rat["ratio"])
                    lo.append(max(0.0, rat["ratio"] - rat["ratio_min"]))
                    hi.append(max(0.0, rat["ratio_max"] - rat["ratio"]))
            if any(not math.isnan(v) for v in vals):
                series[b] = (vals, [lo, hi])
        if cases:
            panels.append(("End to end: total tok/s relative to FLASH_ATTN", cases, series))
    if not panels:
        return None
    width_in = max(8.0, max(len(p[1]) for p in panels) * 0.9 + 3)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width_in, 4.8 * len(panels)), squeeze=False)
    for ax, (title, cases, series) in zip(axes[:, 0], panels):
        n = max(1, len(series))
        w = 0.8 / n
        xs = list(range(len(cases)))
        for i, (b, (vals, err)) in enumerate(series.items()):
            pos = [x - 0.4 + w * (i + 0.5) for x in xs]
            bars = ax.bar(pos, [0 if math.isnan(v) else v for v in vals], w, label=b,
                          yerr=err, capsize=2 if err else 0)
            for rect, v in zip(bars, vals):
                if not math.isnan(v):
                    ax.annotate(f"{v:.2f}", (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                                ha="center", va="bottom", fontsize=6, rotation=90,
                                xytext=(0, 2), textcoords="offset points")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(xs)
        ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("relative speed")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    c = summary.get("ceilings", {})
    if c.get("gpu") or c.get("date"):
        fig.suptitle(f"{c.get('gpu', '')} {c.get('date', '')}".strip(), fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def render(directory: str | os.PathLike) -> tuple[Path, Path | None]:
    """Write ``table.md`` and ``plot.png`` from ``summary.json`` in ``directory``."""
    d = Path(directory)
    summary = load_summary(d)
    table = d / "table.md"
    d.mkdir(parents=True, exist_ok=True)
    table.write_text(render_table(summary))
    plot = render_plot(summary, d / "plot.png")
    return table, plot
