#!/usr/bin/env python3
"""Pick the ring option that reached the control's turn-1 wall time, from a
``kv_tier_bench.py --turns 1`` run's ``repeats.jsonl``, so that one device chain can go
straight on to the 3-turn run of the winner (a lease has no time for a round trip).

    python3 scripts/kv_tier_pick.py RESULTS_DIR --control ion-noring \
        --candidates ion-hostids,ion-gather-drain --within 0.2

Prints the candidate with the lowest mean wall time when that mean is within ``--within``
seconds of the control's, else nothing; exit 0 either way, 2 when the control or every
candidate has no repeat (nothing to compare)."""

import argparse
import json
import os
import sys


def mean_walls(records: list[dict]) -> dict[str, float]:
    """Mean ``wall_s`` per config over its repeats."""
    by: dict[str, list[float]] = {}
    for r in records:
        by.setdefault(r["config"], []).append(float(r["wall_s"]))
    return {k: sum(v) / len(v) for k, v in by.items()}


def pick(records: list[dict], control: str, candidates: list[str],
         within_s: float) -> str | None:
    """The candidate with the lowest mean wall time, if within ``within_s`` of
    ``control``'s mean; None otherwise.  Raises ``LookupError`` when the control or all
    candidates have no repeat."""
    walls = mean_walls(records)
    if control not in walls:
        raise LookupError(f"no repeat of the control {control!r}")
    have = [c for c in candidates if c in walls]
    if not have:
        raise LookupError(f"no repeat of any candidate {candidates}")
    best = min(have, key=lambda c: walls[c])
    return best if walls[best] - walls[control] <= within_s else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="kv_tier_bench.py --out directory (repeats.jsonl)")
    ap.add_argument("--control", required=True)
    ap.add_argument("--candidates", required=True, help="comma-separated config names")
    ap.add_argument("--within", type=float, required=True, help="seconds over the control")
    a = ap.parse_args(argv)
    path = os.path.join(a.results, "repeats.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    try:
        best = pick(records, a.control, a.candidates.split(","), a.within)
    except LookupError as e:
        print(f"kv_tier_pick: {e} in {path}", file=sys.stderr)
        return 2
    if best:
        print(best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
