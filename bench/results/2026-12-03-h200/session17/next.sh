#!/usr/bin/env bash
# The next lease's first call (bench/notes.md, seventeenth session, "Next lease"): the GPU
# tests of vec_straddle and skip_idle, then suite "engine" with both experiments beside the
# default, FA3 and FA3's layer. Needs the cute and vLLM bundles (FA3 comes from vLLM).
#   . .gpu/cute/env.sh && . /tmp/ion-gpu/env.sh && bash bench/results/2026-12-03-h200/session17/next.sh $OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
timeout ${TEST_S:-240} python3 -m pytest -m gpu -q tests/test_vec_straddle_gpu.py \
  > "$out/vec_straddle_gpu.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$out/vec_straddle_gpu.log"
bash "$(dirname "$0")/engine.sh" "$out/engine"
