#!/usr/bin/env bash
# Suite "engine": the prefill-carrying steps of the seventeenth session's profile (offline
# seed at serve's 8192-token budget), where ION's 192-row kernel averaged 1,099 us a call
# in the engine against FA3's 963 while the kernel bench had it at FA3's speed. Each step
# as vLLM's scheduler makes it (a prompt continuing at a context that is not a page
# multiple), the same step with that context rounded to a page (-aligned: no straddling
# fresh-tile store), and with the engine's strided q/key/value (-qkv); ion-auto-fused-vs runs
# the vectorized straddle copy (ION_VEC_STRADDLE=1), -si idle warpgroups without MMAs
# (ION_SKIP_IDLE=1), -vs-si both, on the same steps.
#   bash bench/results/2026-12-03-h200/session17/engine.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
b=${KB_BACKENDS:-ion-auto-fused,ion-auto-fused-vs,ion-auto-fused-si,ion-auto-fused-vs-si,fa3,fa3-layer}
timeout ${KB_S:-300} python3 -m ion_vllm.bench.cli kernel --suite engine \
  --backends "$b" --timing interleaved --out "$out/kb" > "$out/kb.log" 2>&1
echo "kbench rc=$?"
grep -E "rel_err|ERROR|skipped|Error" "$out/kb.log" | head -20
cat "$out/kb/table.md" 2>/dev/null
