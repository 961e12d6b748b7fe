"""Main against the tag, per case, from ion-bench kernel's summary.json:
python3 compare.py kbench/summary.json  (prints a markdown table; > 1.00: main is slower)."""
import json
import sys

recs = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "kbench/summary.json"))["records"]
us = {(r["case"], r["backend"]): r["median_us"] for r in recs if r.get("status") == "ok"}
cases = list(dict.fromkeys(r["case"] for r in recs))
print("| case | tag-ion µs | ion µs | ion / tag | tag-ion-attn µs | ion-attn µs | ion-attn / tag | fa3 µs |")
print("|---|---|---|---|---|---|---|---|")
worst = 0.0
for c in cases:
    a, b = us[(c, "tag-ion")], us[(c, "ion")]
    x, y = us[(c, "tag-ion-attn")], us[(c, "ion-attn")]
    worst = max(worst, b / a, y / x)
    print(f"| {c} | {a:.1f} | {b:.1f} | {b / a:.3f} | {x:.1f} | {y:.1f} | {y / x:.3f} | "
          f"{us[(c, 'fa3')]:.1f} |")
print(f"\nslowest main / tag: {worst:.3f}")
