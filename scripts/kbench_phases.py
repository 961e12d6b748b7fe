#!/usr/bin/env python
"""Per-phase medians of ``ion-bench kernel`` runs: for each case and backend of a
``summary.json``, the median of the first calls and of the last calls (``iter_us``, in call
order) beside the whole run's median.

Sustained runs on the H200 step into a phase 7-14% slower part-way through (FA3 too;
bench/notes.md, ninth and tenth sessions), so an A/B reads the two phases apart:

    python scripts/kbench_phases.py bench/results/.../kbench/summary.json [--case prefill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def phases(records, first: int = 10, last: int = 10, case_filter: str = ""):
    """(case, backend, median, first-calls median, last-calls median, calls) per ok record."""
    out = []
    for r in records:
        if r.get("status") != "ok" or case_filter not in r.get("case", ""):
            continue
        it = r.get("iter_us") or []
        if len(it) < first + last:
            continue
        out.append((r["case"], r["backend"], statistics.median(it),
                    statistics.median(it[:first]), statistics.median(it[-last:]), len(it)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("summaries", nargs="+", help="ion-bench kernel summary.json files")
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--first", type=int, default=10)
    ap.add_argument("--last", type=int, default=10)
    args = ap.parse_args(argv)
    for path in args.summaries:
        with open(path) as f:
            recs = json.load(f)["records"]
        print(f"# {path}")
        print(f"| case | backend | median µs | calls 1-{args.first} | last {args.last} calls |")
        print("|---|---|---|---|---|")
        for case, be, med, fast, slow, n in phases(recs, args.first, args.last, args.case):
            print(f"| {case} | {be} | {med:.1f} | {fast:.1f} | {slow:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
