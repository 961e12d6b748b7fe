#!/usr/bin/env bash
# Fifteenth session: the e2e workloads' steady-state steps (suite "steps": 31 or 16 decodes
# at 8k beside a ~8k fresh prefill chunk; 63 decodes at 4.6k beside 8129 prefill tokens),
# which the auto policy gives 64-row tiles (decode streaming > 7% of the prefill MMA time),
# against the same steps forced onto 128- and 192-row tiles, FA3 and FA3's layer.
#   bash bench/results/2026-12-03-h200/session15/steps.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
b=ion-auto-fused,ion-auto-fused-t128,ion-auto-fused-t192,fa3,fa3-layer
timeout ${KB_S:-300} python3 -m ion_vllm.bench.cli kernel --suite steps \
  --backends "$b" --timing interleaved --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
grep -E "rel_err|ERROR|skipped" "$out/kb.log" | head -20
cat "$out/kb/table.md" 2>/dev/null
