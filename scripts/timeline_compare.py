#!/usr/bin/env python3
"""Compare the compute streams of two profiled waves from their saved timelines
(``timeline-<config>.npz``, written by ``kv_tier_bench.py --profile-dir`` into its results
folder; ``ion_vllm/bench/gap_profile.py``), on a CPU:

    python3 scripts/timeline_compare.py RESULTS/timeline-ion-noring.npz \\
        RESULTS/timeline-ion.npz [--window-ms 10] [--top 10] [--out compare.md]

Prints, for A then B: the gap tables of ``gap_profile.markdown_lines``; the windows with
the most idle time in each; the short idle time per kernel boundary by the time since the
last side-stream kernel (``gap_profile.idle_after_side_kernels``); and the kernel
boundaries (pairs of kernels around gaps under 20 us) whose summed gap grew or shrank most
from A to B."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ion_vllm.bench import gap_profile as gp  # noqa: E402
from ion_vllm.bench.stream_trace import compute_stream  # noqa: E402


def label_of(path: str) -> str:
    """``timeline-ion.npz`` -> ``ion``."""
    return os.path.basename(path).removeprefix("timeline-").removesuffix(".npz")


def compare_lines(a: tuple[str, list[dict]], b: tuple[str, list[dict]],
                  window_us: float = 10_000.0, top: int = 10) -> list[str]:
    """The report for two (label, activities) waves."""
    (la, acts_a), (lb, acts_b) = a, b
    # each wave's compute stream and its gaps, walked once for every table below
    waves = []
    for label, acts in ((la, acts_a), (lb, acts_b)):
        s = compute_stream(acts)
        waves.append((label, acts, s, gp.idle_intervals(acts, s)))
    out = [f"# Compute-stream timelines: {la} (A) against {lb} (B)"]
    out += gp.markdown_lines([(label, gp.summarize_gaps(acts, s, window_us=window_us,
                                                        gaps=gaps))
                              for label, acts, s, gaps in waves])
    for label, acts, s, gaps in waves:
        rows = gp.top_idle_windows(acts, s, window_us, top, gaps=gaps)
        out += ["", f"{label}: the {len(rows)} {window_us / 1e3:g} ms windows with the most "
                "idle time (start ms: idle us):", "",
                "; ".join(f"{r['start_ms']:g}: {r['idle_us']:.0f}" for r in rows) or "-"]
    since = [(label, gp.idle_after_side_kernels(acts, s, gaps=gaps))
             for label, acts, s, gaps in waves]
    out += ["", "Idle in gaps under 20 us per compute kernel boundary, by the time since the "
            "last kernel on another stream (boundaries; us a boundary):", "",
            "| config | " + " | ".join(r["bin"] for r in since[0][1]) + " |",
            "|---|" + "---|" * len(since[0][1])]
    for label, rows in since:
        cells = [f"{r['boundaries']}; {r['per_boundary_us']:.3f}" if r["boundaries"] else "-"
                 for r in rows]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    gaps_a, gaps_b = waves[0][3], waves[1][3]
    deltas = gp.pair_deltas(gaps_a, gaps_b, top=top)
    out += ["", f"Kernel boundaries (gaps under 20 us) by change from {la} to {lb}, largest "
            "first (summed gap us):", "",
            "| before -> after | count A | count B | us A | us B | delta us |",
            "|---|---|---|---|---|---|"]
    out += [f"| {r['before'][:40]} -> {r['after'][:40]} | {r['count_a']} | {r['count_b']} | "
            f"{r['us_a']:.1f} | {r['us_b']:.1f} | {r['delta_us']:+.1f} |" for r in deltas]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="timeline of A (the control)")
    ap.add_argument("b", help="timeline of B")
    ap.add_argument("--window-ms", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    waves = [(label_of(p), gp.load_timeline(p)) for p in (args.a, args.b)]
    text = "\n".join(compare_lines(*waves, window_us=args.window_ms * 1e3, top=args.top))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
