#!/usr/bin/env bash
# Seventeenth session: suite "multi", the offline LLM's 16384-token prefill steps that hold
# several prompts (the sixteenth session's profile had ION's attention ~15% slower than
# FA3's in such steps), at the auto tile size and forced 128 / 192 rows, against FA3 and
# FA3's layer (attention + reshape_and_cache). One prompt of 8192 (anchors) rides along as
# the control: there ION was 5% faster.
#   bash bench/results/2026-12-03-h200/session17/multi.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
b=ion-auto-fused,ion-auto-fused-t128,ion-auto-fused-t192,fa3,fa3-layer
timeout ${KB_S:-300} python3 -m ion_vllm.bench.cli kernel --suite multi --case prefill-1x8192-h28/4-d128 \
  --backends "$b" --timing interleaved --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
grep -E "rel_err|ERROR|skipped|Error" "$out/kb.log" | head -20
cat "$out/kb/table.md" 2>/dev/null
