#!/usr/bin/env bash
# Fourteenth session, chain call 3 (after the v1, v2 bundle calls): v17 GPU tests, then the
# anchors + chunked-prefill suites interleaved against FA3 and FA3's layer (cache write +
# attention), and a prefill-only rerun.
#   bash bench/results/2026-12-02-h200/session14/c3_fa3.sh OUT
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
b=ion-auto,ion-auto-c3,ion-auto-fused,ion-auto-fused-c3,fa3,fa3-layer
timeout 300 python3 -m ion_vllm.bench.cli kernel --suite anchors --suite chunks \
  --backends "$b" --timing interleaved --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
timeout 150 python3 -m ion_vllm.bench.cli kernel --case prefill-1x8192-h28/4-d128 \
  --backends "$b" --timing interleaved --no-ceilings --out "$out/pf" > "$out/pf.log" 2>&1
echo "prefill rerun rc=$?"
python3 scripts/kbench_phases.py "$out"/kb/summary.json "$out"/pf/summary.json \
  > "$out/phases.md" 2>&1 || true
grep -E "rel_err|ERROR|skipped" "$out/kb.log" | head -20
cat "$out/kb/table.md" 2>/dev/null
cat "$out/phases.md"
