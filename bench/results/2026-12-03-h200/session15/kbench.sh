#!/usr/bin/env bash
# Fifteenth session: v18 (split unpacked tiles) against the planner before it and FA3, on the
# anchors + chunked-prefill suites, interleaved: ion-auto-fused (the default layer, now with
# 192-row tiles where the backend's auto policy picks them and unpacked splits),
# ion-auto-fused-nsu (the same without unpacked splits: the planner before v18),
# ion-auto-fused-c3 (192 rows where auto picks 128), fa3 and fa3-layer (cache write + FA3).
#   bash bench/results/2026-12-03-h200/session15/kbench.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
b=${KB_BACKENDS:-ion-auto-fused,ion-auto-fused-nsu,ion-auto-fused-c3,fa3,fa3-layer}
timeout ${KB_S:-420} python3 -m ion_vllm.bench.cli kernel --suite anchors --suite chunks \
  --backends "$b" --timing interleaved --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
grep -E "rel_err|ERROR|skipped" "$out/kb.log" | head -20
cat "$out/kb/table.md" 2>/dev/null
