#!/usr/bin/env bash
# Session 19, first call: where the 16-byte-copy kernels lose 1.5-2.5% on steps where
# nothing straddles (session 18, n3/), and what a straddling step costs them.
# Nsight Compute on suite "engine" step s20, page-aligned twin (both kernels, nothing
# copied) and as the engine runs it (misaligned: the 16-byte kernels copy).
#   . .gpu/cute/env.sh && bash bench/results/2026-12-03-h200/session19/ncu.sh $OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 280 bash scripts/ncu_prefill.sh "$out/aligned" ion-auto-fused-vs,ion-auto-fused-novs \
  engine-seed-s20-21d+5314c2366+2857-aligned > "$out/aligned.log" 2>&1
echo "aligned rc=$?"
timeout 200 bash scripts/ncu_prefill.sh "$out/misaligned" ion-auto-fused-vs,ion-auto-fused-novs \
  engine-seed-s20-21d+5314c2366+2857 > "$out/misaligned.log" 2>&1
echo "misaligned rc=$?"
for d in aligned misaligned; do
  [ -d "$out/$d" ] || continue
  tar czf "$out/$d-rep.tgz" -C "$out/$d" prefill.ncu-rep 2>/dev/null && rm -f "$out/$d/prefill.ncu-rep"
  grep -E "Kernel Name|gpu__time_duration|issue_active|stalled_(long_scoreboard|wait|barrier|no_instruction|math_pipe|short_scoreboard|mio|lg_throttle|branch|dispatch|sleeping|membar)[a-z_]*\.ratio" "$out/$d/summary.txt" | head -60
done
