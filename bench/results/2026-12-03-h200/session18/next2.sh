#!/usr/bin/env bash
# Session 18, second call: the batched 16-byte straddle copy (STRADDLE_BATCH) under the GPU
# tests, the cache-tail check (is the bench's non-finite output the NaN of torch.empty in
# masked slots?), and suite "engine" on the bench's finite stale cache.
#   . .gpu/cute/env.sh && . /tmp/ion-gpu/env.sh && bash bench/results/2026-12-03-h200/session18/next2.sh $OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout ${TEST_S:-200} python3 -m pytest -m gpu -q tests/test_vec_straddle_gpu.py \
  > "$out/vec_straddle_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$out/vec_straddle_gpu.log"
timeout 120 python3 scripts/cache_tail_check.py --out "$out/cache_tail" > "$out/cache_tail.log" 2>&1
echo "cache_tail rc=$?"; tail -8 "$out/cache_tail.log"
KB_BACKENDS=${KB_BACKENDS:-ion-auto-fused,ion-auto-fused-vs,ion-auto-fused-si,fa3} \
  bash bench/results/2026-12-03-h200/session17/engine.sh "$out/engine"
tar czf "$out/engine-kb.tgz" -C "$out/engine" kb 2>/dev/null && rm -rf "$out/engine/kb"
