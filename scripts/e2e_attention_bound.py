#!/usr/bin/env python
"""What end-to-end speedup an attention backend can give a workload at most, from measured
numbers: the torch-profiler run of ``scripts/attention_share.py`` (GPU time by category,
attention calls split into decode calls and prefill-carrying calls) and the copy-bandwidth
and GEMM ceilings that ``ion-bench kernel`` measured on the same GPU model.

The profiled run is ``profile_prompts`` prompts of ``input_len`` tokens that each generate
``output_len`` tokens (or the lengths it recorded, ``--range-ratio``), so its attention
work is known exactly, however the engine batches and chunks it (barring preemption):

* prefill: every prompt's causal attention once, ``2 * input_len^2 * head_dim * q_heads``
  FLOPs a layer (QK^T and PV over the causal half), however the engine chunks it;
* decode: ``output_len - 1`` steps that each read every sequence's K and V, about
  ``input_len + output_len / 2`` tokens of ``2 * kv_heads * head_dim * elt_bytes`` a layer.

A backend whose prefill attention ran at a fraction ``e_p`` of the GEMM ceiling and whose
decode attention took ``D`` would turn the baseline's GPU time ``T`` (attention ``A``) into
``T - A + D + F / (e_p * G)``; the rest of the attention category (the KV-cache write, calls
under 20 us) is taken as free, and wall time is taken to shrink with GPU time. So

    speedup <= T / (T - A + D + F / (e_p * G))

``D`` is the faster of the decode floor at the copy ceiling and the fastest decode time
measured in the profile (a read-only stream can beat the copy ceiling, which moves reads and
writes). The script prints the bound at ``e_p`` = 1 (100% of the GEMM ceiling, which no
attention kernel reaches), at the best prefill fraction measured by the kernel suite, and
the ``e_p`` the bar needs.

    python scripts/e2e_attention_bound.py \\
        --share bench/results/2026-12-03-h200/session17/share-reuse/share/attention_share.json \\
        --kernel bench/results/2026-12-03-h200/session19/suites/anchors/summary.json \\
        --out bench/results/2026-12-04-cpu/e2e-attention-bound
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PREFILL_CASE = "prefill-1x8192-h28/4-d128"


def attention_work(workload: dict, layers: int, q_heads: int, kv_heads: int, head_dim: int,
                   elt_bytes: int = 2) -> tuple[float, float]:
    """(prefill FLOPs, decode bytes) of a profiled run of ``attention_share.py``: its
    requests' own ``profile_lengths`` when it recorded them (``--range-ratio``), else
    ``profile_prompts`` requests of ``input_len`` / ``output_len``.  A request of prompt
    ``s`` and output ``o`` reads ``s + k`` tokens in its k-th decode step, k = 1 .. o - 1."""
    lens = workload.get("profile_lengths") or (
        [(workload["input_len"], workload["output_len"])] * workload["profile_prompts"])
    tokens2 = sum(float(s) * s for s, _ in lens)
    reads = sum((o - 1) * (s + o / 2.0) for s, o in lens if o > 1)
    flops = layers * 2.0 * tokens2 * head_dim * q_heads
    decode_bytes = layers * reads * 2.0 * kv_heads * head_dim * elt_bytes
    return flops, decode_bytes


def best_prefill_fraction(summary: dict, case: str) -> tuple[str, float]:
    """The best (backend, FLOPs / median time / GEMM ceiling) on ``case`` in a kernel-suite
    summary."""
    g = summary["ceilings"]["gemm_tflops"] * 1e12
    best = max(((r["backend"], r["flops"] / (r["median_us"] * 1e-6) / g)
                for r in summary["records"]
                if r.get("case") == case and r.get("status", "ok") == "ok"),
               key=lambda x: x[1], default=None)
    if best is None:
        raise KeyError(f"no record of {case} in the kernel summary")
    return best


def analyse(share_doc: dict, summary: dict, *, layers: int, q_heads: int, kv_heads: int,
            head_dim: int, bar: float, prefill_case: str = PREFILL_CASE) -> dict:
    base = share_doc["meta"]["baseline"]
    res = share_doc["results"]
    b = res[base]
    T, A = b["total_us"], b["category_us"]["attention"]
    flops, dbytes = attention_work(share_doc["meta"]["workload"], layers, q_heads, kv_heads,
                                   head_dim)
    G = summary["ceilings"]["gemm_tflops"] * 1e12
    C = summary["ceilings"]["copy_gbps"] * 1e9
    decode_floor = dbytes / C * 1e6
    measured = {k: {"decode_us": v["attention_calls"]["short"]["us"],
                    "prefill_us": v["attention_calls"]["long"]["us"],
                    "attention_us": v["category_us"]["attention"], "total_us": v["total_us"]}
                for k, v in res.items() if "attention_calls" in v}
    D = min([decode_floor] + [m["decode_us"] for m in measured.values()])

    def speedup(e_p: float) -> float:
        return T / (T - A + D + flops / (e_p * G) * 1e6)

    best_backend, best_ep = best_prefill_fraction(summary, prefill_case)
    # the bar needs T / bar >= T - A + D + F / (e_p G)
    room = T / bar - (T - A + D)
    needed = flops / G * 1e6 / room if room > 0 else float("inf")
    for m in measured.values():
        m["decode_copy_fraction"] = dbytes / (m["decode_us"] * 1e-6) / C
        m["prefill_gemm_fraction"] = flops / (m["prefill_us"] * 1e-6) / G
    return {
        "baseline": base, "workload": share_doc["meta"]["workload"],
        "model": {"layers": layers, "q_heads": q_heads, "kv_heads": kv_heads,
                  "head_dim": head_dim},
        "ceilings": {"copy_gbps": C / 1e9, "gemm_tflops": G / 1e12},
        "prefill_tflop": flops / 1e12, "decode_tb": dbytes / 1e12,
        "decode_floor_ms": decode_floor / 1e3, "decode_used_ms": D / 1e3,
        "baseline_total_ms": T / 1e3, "baseline_attention_ms": A / 1e3,
        "attention_share": A / T, "measured": measured,
        "bound_at_gemm_ceiling": speedup(1.0),
        "best_prefill": {"backend": best_backend, "case": prefill_case,
                         "gemm_fraction": best_ep, "bound": speedup(best_ep)},
        "bar": bar, "prefill_gemm_fraction_needed": needed,
    }


def report(r: dict) -> str:
    base = r["baseline"]
    lines = [
        f"# How far attention alone can move this workload against {base}",
        "",
        f"Workload (profiled): {json.dumps(r['workload'])}; model {json.dumps(r['model'])}. "
        f"Ceilings: copy {r['ceilings']['copy_gbps']:.0f} GB/s, GEMM "
        f"{r['ceilings']['gemm_tflops']:.0f} TFLOP/s.",
        "",
        f"Attention work: prefill {r['prefill_tflop']:.1f} TFLOP, decode "
        f"{r['decode_tb']:.2f} TB of K/V reads (floor at the copy ceiling "
        f"{r['decode_floor_ms']:.1f} ms). {base}: GPU time {r['baseline_total_ms']:.1f} ms, "
        f"attention {r['baseline_attention_ms']:.1f} ms ({r['attention_share']:.1%}).",
        "",
        "| backend (profiled) | decode calls ms | share of copy ceiling | prefill-carrying "
        "calls ms | share of GEMM ceiling |",
        "|---|---|---|---|---|",
    ]
    for k, m in r["measured"].items():
        lines.append(f"| {k} | {m['decode_us'] / 1e3:.1f} | {m['decode_copy_fraction']:.3f} | "
                     f"{m['prefill_us'] / 1e3:.1f} | {m['prefill_gemm_fraction']:.3f} |")
    bp = r["best_prefill"]
    lines += [
        "",
        f"With decode at {r['decode_used_ms']:.1f} ms (the faster of the floor and the best "
        "measured) and the rest of the attention category free:",
        "",
        "| prefill attention at | speedup bound |",
        "|---|---|",
        f"| 100% of the GEMM ceiling | {r['bound_at_gemm_ceiling']:.4f} |",
        f"| {bp['gemm_fraction']:.3f} of it (best measured: {bp['backend']}, {bp['case']}) "
        f"| {bp['bound']:.4f} |",
        "",
        f"The bar {r['bar']} needs prefill attention at "
        f"**{r['prefill_gemm_fraction_needed']:.3f}** of the GEMM ceiling.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share", required=True, help="attention_share.json")
    ap.add_argument("--kernel", required=True, help="ion-bench kernel summary.json")
    ap.add_argument("--layers", type=int, default=28)  # the demo model: Qwen2.5-7B
    ap.add_argument("--q-heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prefill-case", default=PREFILL_CASE)
    ap.add_argument("--bar", type=float, default=1.05)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    with open(args.share) as f:
        share_doc = json.load(f)
    with open(args.kernel) as f:
        summary = json.load(f)
    r = analyse(share_doc, summary, layers=args.layers, q_heads=args.q_heads,
                kv_heads=args.kv_heads, head_dim=args.head_dim, bar=args.bar,
                prefill_case=args.prefill_case)
    r.update(share=args.share, kernel=args.kernel)
    text = report(r)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(r, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
