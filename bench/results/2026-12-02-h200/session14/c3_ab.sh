#!/usr/bin/env bash
# Fourteenth session, call 1: v17 (192-row tiles on three consumer warpgroups) correctness,
# then the prefill / mixed A/B against the 128-row default (no vLLM bundle: no FA3 here).
#   bash bench/results/2026-12-02-h200/session14/c3_ab.sh OUT
# Assumes the cute bundle is sourced; runs the project from the checkout (PYTHONPATH).
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
t=tests/test_three_consumers_gpu.py
i=0
for k in "reference and bf16" "reference and fp16" "split_kv or long_prefill" "fused"; do
  CUTE_DSL_CACHE_DIR=/tmp/ion-cute-c3$i timeout 240 python3 -m pytest -m gpu -q \
    -p no:cacheprovider "$t" -k "$k" > "$out/pytest-c3.$i.log" 2>&1 &
  i=$((i + 1))
done
wait
for f in "$out"/pytest-c3.*.log; do echo "$f: $(tail -1 "$f")"; done
b=ion-auto,ion-auto-c3,ion-auto-fused,ion-auto-fused-c3
timeout 240 python3 -m ion_vllm.bench.cli kernel \
  --case prefill-1x8192-h28/4-d128,mixed-32x8192+p2048-h28/4-d128 \
  --backends "$b" --timing interleaved --no-ceilings --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
python3 scripts/kbench_phases.py "$out"/kb/summary.json > "$out/kb-phases.md" 2>&1 || true
tail -14 "$out/kb.log"
cat "$out/kb-phases.md" | head -30
