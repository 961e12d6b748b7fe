#!/usr/bin/env python
"""Warp-stall samples of one kernel, from an Nsight Compute source page (SASS view).

``scripts/ncu_prefill.sh`` writes ``OUT/source-<n>.csv`` (``ncu --page source --csv
--print-source sass``): one row per SASS instruction with its stall-sample counts.  This
prints, per file, the total samples, the stall reasons summed over the kernel, and the
instructions with the most samples of one reason (``--reason``, default ``barrier``), so
that two kernels can be compared where they differ:

    python scripts/ncu_source_stalls.py --reason barrier A.csv[.gz] B.csv[.gz]
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys


def read_source(path: str) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, rows as dicts keyed by the header) of an ncu source-page CSV; the
    first line names the kernel, the second is the header."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(io.StringIO(f.read())))
    if len(rows) < 2 or not rows[0] or rows[0][0] != "Kernel Name":
        raise ValueError(f"{path}: not an ncu source page (no 'Kernel Name' line)")
    head = rows[1]
    return rows[0][1], [dict(zip(head, r)) for r in rows[2:]]


def _int(v: str | None) -> int:
    try:
        return int(float(v or 0))
    except ValueError:
        return 0


def stall_totals(rows: list[dict[str, str]]) -> collections.Counter:
    """Samples per stall reason (all samples, issued or not), summed over instructions."""
    tot: collections.Counter = collections.Counter()
    for r in rows:
        for k, v in r.items():
            if k.startswith("stall_") and "Not Issued" not in k:
                tot[k[len("stall_"):]] += _int(v)
    return tot


def top_instructions(rows: list[dict[str, str]], reason: str, n: int):
    """The ``n`` instructions with the most ``stall_<reason>`` samples:
    (samples, index, executed, SASS)."""
    col = f"stall_{reason}"
    lst = [(_int(r.get(col)), i, _int(r.get("Instructions Executed")),
            (r.get("Source") or "").strip()) for i, r in enumerate(rows)]
    return sorted(lst, key=lambda x: (-x[0], x[1]))[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="ncu source-page CSVs (optionally .gz)")
    ap.add_argument("--reason", default="barrier", help="stall reason of the top list")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args(argv)
    for path in args.files:
        name, rows = read_source(path)
        tot = stall_totals(rows)
        samples = sum(_int(r.get("# Samples")) for r in rows)
        print(f"{path}: {name[:70]}")
        print(f"  {len(rows)} instructions, {samples} samples")
        print("  " + ", ".join(f"{k}={v}" for k, v in tot.most_common(12)))
        for s, i, e, src in top_instructions(rows, args.reason, args.top):
            print(f"  {args.reason:>10} {s:7d}  @{i:<5d} executed {e:>10}  {src[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
