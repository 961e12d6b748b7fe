"""Result storage (summary.json), merging, markdown table and matplotlib plot.

``summary.json``::

    {"ceilings": {"copy_gbps", "gemm_tflops", "gpu", "date", "versions": {...}},
     "records": [{"suite": "kernel" | "e2e" | "startup", "case", "backend", ...}, ...]}

One record per (suite, case, backend); re-running a subset replaces the matching records
and keeps the others.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import statistics
from pathlib import Path

KERNEL_ORDER = ("ion", "ion-attn", "ion-append", "fa3", "fa3-layer", "fa4", "triton")
KERNEL_BASELINE = "fa3"
E2E_BASELINE = "FLASH_ATTN"
STARTUP_STATES = ("prime", "cute-cold", "cold", "warm")


# --------------------------------------------------------------------------- summary io

def slugify(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name.strip()).strip("-").lower() or "unknown-gpu"


def default_results_dir(gpu_name: str, date: str | None = None,
                        root: str | os.PathLike = Path("bench") / "results") -> Path:
    return Path(root) / f"{date or _dt.date.today().isoformat()}-{slugify(gpu_name)}"


def load_summary(path: str | os.PathLike) -> dict:
    """``summary.json`` of a directory (or the file itself); empty if absent."""
    p = Path(path)
    p = p if p.suffix == ".json" else p / "summary.json"
    data = json.loads(p.read_text()) if p.exists() else {}
    return {"ceilings": data.get("ceilings", {}), "records": data.get("records", [])}


def record_key(rec: dict) -> tuple:
    return (rec.get("suite"), rec.get("case"), rec.get("backend"))


def merge_records(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each record whose key appears in ``new`` replaced in place, then the
    rest of ``new`` in order."""
    by_key = {record_key(r): r for r in new}
    out = [by_key.get(record_key(r), r) for r in old]
    seen = {record_key(r) for r in old}
    out += [r for k, r in by_key.items() if k not in seen]
    return out


def merge_ceilings(old: dict, new: dict) -> dict:
    """Newer non-None values win; ``versions`` dicts are merged."""
    out = dict(old)
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **{kk: vv for kk, vv in v.items() if vv is not None}}
        elif v is not None:
            out[k] = v
    return out


def update_summary(directory: str | os.PathLike, records: list[dict],
                   ceilings: dict | None = None) -> dict:
    """Load, merge ``records`` / ``ceilings`` in, save atomically; returns the summary."""
    d = Path(directory)
    old = load_summary(d)
    merged = {"ceilings": merge_ceilings(old["ceilings"], ceilings or {}),
              "records": merge_records(old["records"], records)}
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / ".summary.json.tmp"
    tmp.write_text(json.dumps(merged, indent=2, default=_json_default) + "\n")
    os.replace(tmp, d / "summary.json")
    return merged


def _json_default(o):
    if hasattr(o, "item"):  # numpy scalars
        return o.item()
    return str(o)


# --------------------------------------------------------------------------- statistics

def e2e_aggregate(runs: list[dict]) -> dict:
    """Mean / min / max of total and output tok/s over repeats."""
    out: dict = {"repeats": len(runs)}
    for key in ("total_tok_s", "output_tok_s"):
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.fmean(vals) if vals else None
        if vals:
            out[key + "_min"], out[key + "_max"] = min(vals), max(vals)
    return out


def e2e_ratio(a: dict, base: dict, key: str = "total_tok_s") -> dict | None:
    """``a``/``base`` ratio of the means of ``key``, and the spread, mean and sample standard
    deviation (None for one pair) of the per-repeat ratios: a run pairs with the baseline
    run of the same ``repeat`` number (they ran next to each other), else by position."""
    def by_repeat(rec):
        runs = rec.get("runs", [])
        return {r.get("repeat", i): r.get(key) for i, r in enumerate(runs)}
    ra, rb = by_repeat(a), by_repeat(base)
    rs = [ra[k] / rb[k] for k in ra if ra[k] and rb.get(k)]
    if not rs or not a.get(key) or not base.get(key):
        return None
    return {"ratio": a[key] / base[key], "ratio_min": min(rs), "ratio_max": max(rs),
            "ratio_mean": statistics.fmean(rs),
            "ratio_sd": statistics.stdev(rs) if len(rs) > 1 else None, "pairs": len(rs)}


def _ok(rec: dict | None) -> bool:
    return bool(rec) and rec.get("status", "ok") == "ok" and rec.get("median_us") is not None


def kernel_speedup(rec: dict | None, base: dict | None) -> float | None:
    """Baseline µs / ``rec`` µs (> 1: ``rec`` is faster)."""
    return base["median_us"] / rec["median_us"] if _ok(rec) and _ok(base) else None


def _order(names, preferred) -> list[str]:
    names = list(dict.fromkeys(names))
    return [n for n in preferred if n in names] + [n for n in names if n not in preferred]


# --------------------------------------------------------------------------- tables

def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: list[str], rows: list[list]) -> list[str]:
    return [_row(head), "|" + "---|" * len(head)] + [_row(r) for r in rows]


def _not_measured(recs: list[dict]) -> list[str]:
    bad = {}
    for r in recs:
        if r.get("status", "ok") not in ("ok",):
            where = r["backend"] if r.get("status") == "skipped" else f"{r['case']} / {r['backend']}"
            msg = str(r.get("error") or f"rel_err {r.get('rel_err')}").splitlines()[0][:200]
            bad.setdefault(where, f"- {where}: {r.get('status')}: {msg}")
    return ["", "Not measured (or wrong):"] + list(bad.values()) if bad else []


def _kernel_cell(rec: dict | None) -> str:
    if rec is None:
        return ""
    if rec.get("median_us") is None:
        return rec.get("status", "n/a")
    fr = [f"{name} {rec[k]:.2f}" for name, k in (("bw", "frac_copy_bw"), ("mma", "frac_gemm"))
          if rec.get(k) is not None]
    cell = f"{rec['median_us']:.1f}" + (f" ({', '.join(fr)})" if fr else "")
    return cell if _ok(rec) else f"WRONG {cell}"


def _kernel_lines(recs: list[dict]) -> list[str]:
    cases = list(dict.fromkeys(r["case"] for r in recs))
    backends = _order([r["backend"] for r in recs], KERNEL_ORDER)
    by = {(r["case"], r["backend"]): r for r in recs}
    others = [b for b in backends if b != KERNEL_BASELINE]
    rows = []
    for c in cases:
        sp = [kernel_speedup(by.get((c, b)), by.get((c, KERNEL_BASELINE))) for b in others]
        rows.append([c] + [_kernel_cell(by.get((c, b))) for b in backends]
                    + ["–" if x is None else f"{x:.2f}x" for x in sp])
    head = (["case"] + [f"{b} µs (frac)" for b in backends]
            + [f"{b}/{KERNEL_BASELINE}" for b in others])
    timings = sorted({r["timing"] for r in recs if r.get("timing")})
    return (["## Kernel (median µs; frac = share of the copy-bandwidth / GEMM ceiling; "
             f"X/{KERNEL_BASELINE} = {KERNEL_BASELINE} µs / X µs, > 1: X is faster)", ""]
            + ([f"Timing: {', '.join(timings)}.", ""] if timings else [])
            + _table(head, rows) + _not_measured(recs))


def _spread(rec: dict | None, key: str) -> str:
    if not rec or rec.get(key) is None:
        return rec.get("status", "–") if rec else ""
    lo, hi = rec.get(key + "_min"), rec.get(key + "_max")
    return f"{rec[key]:.0f}" + ("" if lo is None else f" ({lo:.0f}–{hi:.0f})")


def _ratio_cell(a, base, key) -> str:
    r = e2e_ratio(a, base, key) if a and base else None
    return "–" if r is None else f"{r['ratio']:.3f} ({r['ratio_min']:.3f}–{r['ratio_max']:.3f})"


def _e2e_lines(recs: list[dict]) -> list[str]:
    cases = list(dict.fromkeys(r["case"] for r in recs))
    backends = _order([r["backend"] for r in recs], ("ION", E2E_BASELINE))
    by = {(r["case"], r["backend"]): r for r in recs}
    others = [b for b in backends if b != E2E_BASELINE]
    rows = []
    for c in cases:
        base = by.get((c, E2E_BASELINE))
        reps = sorted({str(by[(c, b)].get("repeats", "")) for b in backends if (c, b) in by})
        rows.append([c, "/".join(reps)]
                    + [cell for key in ("total_tok_s", "output_tok_s")
                       for cell in [_spread(by.get((c, b)), key) for b in backends]
                       + [_ratio_cell(by.get((c, b)), base, key) for b in others]])
    head = ["workload", "repeats"] + [
        h for kind in ("total", "output")
        for h in [f"{b} {kind} tok/s" for b in backends] + [f"{b}/FA {kind}" for b in others]]
    lines = ["## End to end (mean (min–max) over repeats; X/FA = X mean / FLASH_ATTN mean "
             "(spread of the per-repeat ratios))", ""] + _table(head, rows)
    lat = [r for r in recs if r.get("ttft_p50_ms") is not None]
    if lat:
        keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
        lines += [""] + _table(["workload", "backend", "TTFT p50 ms", "TTFT p99 ms",
                                "TPOT p50 ms", "TPOT p99 ms"],
                               [[r["case"], r["backend"]] + ["–" if r.get(k) is None
                                                             else f"{r[k]:.1f}" for k in keys]
                                for r in lat])
    return lines + _not_measured(recs)


def startup_ratio(recs: list[dict], a: str = "ION", b: str = E2E_BASELINE,
                  state: str = "warm") -> float | None:
    """Median time-to-ready of ``a`` / that of ``b`` in ``state``."""
    by = {(r["case"], r["backend"]): r.get("median_s") for r in recs}
    x, y = by.get((state, a)), by.get((state, b))
    return x / y if x and y else None


def _startup_lines(recs: list[dict]) -> list[str]:
    backends = _order([r["backend"] for r in recs], ("ION", E2E_BASELINE))
    by = {(r["case"], r["backend"]): r for r in recs}

    def cell(r):
        if not r or r.get("median_s") is None:
            return (r or {}).get("status", "–")
        ts = [x["ready_s"] for x in r.get("runs", []) if x.get("ready_s") is not None]
        return f"{r['median_s']:.1f}" + (f" ({min(ts):.1f}–{max(ts):.1f}, n={len(ts)})"
                                          if len(ts) > 1 else "")
    states = [s for s in STARTUP_STATES if any(r["case"] == s for r in recs)]
    rows = [[b] + [cell(by.get((s, b))) for s in states] for b in backends]
    lines = ["## Start-up (`vllm serve` until GET /health is 200; median s (min–max); prime: "
             "first start, fills vLLM's caches; cute-cold: the kernel caches emptied; cold: "
             "every cache emptied; warm: every cache filled by the starts before)", ""]
    lines += _table(["backend", *states], rows)
    ratio = startup_ratio(recs)
    if ratio is not None:
        lines += ["", f"ION warm / {E2E_BASELINE} warm = {ratio:.2f}"]
    return lines + _not_measured(recs)


def render_table(summary: dict) -> str:
    c = summary.get("ceilings", {})
    meta = [f"{k}: {c[k]}" for k in ("gpu", "date") if c.get(k)]
    if c.get("copy_gbps"):
        meta.append(f"copy ceiling: {c['copy_gbps']:.0f} GB/s")
    if c.get("gemm_tflops"):
        meta.append(f"bf16 GEMM ceiling: {c['gemm_tflops']:.0f} TFLOP/s")
    if c.get("versions"):
        meta.append("versions: " + ", ".join(f"{k} {v}" for k, v in c["versions"].items() if v))
    lines = ["# ION vs stock vLLM attention", ""] + [f"- {m}" for m in meta] + [""] * bool(meta)
    recs = summary.get("records", [])
    for suite, render in (("kernel", _kernel_lines), ("e2e", _e2e_lines),
                          ("startup", _startup_lines)):
        sub = [r for r in recs if r.get("suite") == suite]
        if sub:
            lines += render(sub) + [""]
    if not recs:
        lines.append("(no records)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plot

def _plot_panels(recs: list[dict]) -> list[tuple[str, list[str], dict]]:
    panels = []
    k = [r for r in recs if r.get("suite") == "kernel"]
    by = {(r["case"], r["backend"]): r for r in k}
    cases = [c for c in dict.fromkeys(r["case"] for r in k) if _ok(by.get((c, KERNEL_BASELINE)))]
    series = {b: ([kernel_speedup(by.get((c, b)), by[(c, KERNEL_BASELINE)]) for c in cases],
                  None) for b in _order([r["backend"] for r in k], KERNEL_ORDER)}
    if cases:
        panels.append((f"Kernel: speed relative to {KERNEL_BASELINE} (higher is faster)",
                       cases, series))
    e = [r for r in recs if r.get("suite") == "e2e"]
    by = {(r["case"], r["backend"]): r for r in e}
    cases = [c for c in dict.fromkeys(r["case"] for r in e)
             if (by.get((c, E2E_BASELINE)) or {}).get("total_tok_s")]
    series = {}
    for b in _order([r["backend"] for r in e], ("ION", E2E_BASELINE)):
        rats = [e2e_ratio(by[(c, b)], by[(c, E2E_BASELINE)]) if (c, b) in by else None
                for c in cases]
        series[b] = ([r and r["ratio"] for r in rats],
                     [[r["ratio"] - r["ratio_min"] if r else 0.0 for r in rats],
                      [r["ratio_max"] - r["ratio"] if r else 0.0 for r in rats]])
    if cases:
        panels.append((f"End to end: total tok/s relative to {E2E_BASELINE}", cases, series))
    return panels


def render_plot(summary: dict, path: str | os.PathLike) -> Path | None:
    """Grouped bars per case: each backend's speed relative to the baseline (kernel: FA3 µs
    / backend µs; e2e: total tok/s ratio, whiskers = per-repeat spread)."""
    panels = _plot_panels(summary.get("records", []))
    if not panels:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = max(8.0, max(len(p[1]) for p in panels) * 0.9 + 3)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 4.8 * len(panels)), squeeze=False)
    for ax, (title, cases, series) in zip(axes[:, 0], panels):
        w = 0.8 / max(1, len(series))
        for i, (b, (vals, err)) in enumerate(series.items()):
            vals = [math.nan if v is None else v for v in vals]
            bars = ax.bar([x - 0.4 + w * (i + 0.5) for x in range(len(cases))],
                          [0 if math.isnan(v) else v for v in vals], w, label=b, yerr=err,
                          capsize=2 if err else 0)
            for rect, v in zip(bars, vals):
                if not math.isnan(v):
                    ax.annotate(f"{v:.2f}", (rect.get_x() + rect.get_width() / 2,
                                             rect.get_height()), ha="center", va="bottom",
                                fontsize=6, rotation=90, xytext=(0, 2), textcoords="offset points")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("relative speed")
        ax.legend(fontsize=8)
        ax.margins(y=0.15)
    c = summary.get("ceilings", {})
    fig.suptitle(f"{c.get('gpu', '')} {c.get('date', '')}".strip(), fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def render(directory: str | os.PathLike, plot: bool = True) -> tuple[Path, Path | None]:
    """Write ``table.md`` (and ``plot.png``) from ``summary.json`` in ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    summary = load_summary(d)
    (d / "table.md").write_text(render_table(summary))
    return d / "table.md", render_plot(summary, d / "plot.png") if plot else None
