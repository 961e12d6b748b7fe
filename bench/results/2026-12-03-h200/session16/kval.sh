#!/usr/bin/env bash
# Sixteenth session: the 500-case randomized sweeps of the current default's kernel forms
# against the fp32 reference (NaN-poisoned outputs, fresh random inputs per case, every 2nd
# case planned with a split-friendly cost model): 192-row tiles (three consumer warpgroups)
# with unpacked prefill tiles and the v18 split of them, plain (kv_append + attention) and
# fused (one launch writes the cache and attends; the cache is checked too), and the
# backend's default 64-row form (fused, unpacked, split-parallel combine). Three sweeps side
# by side (CuTeDSL compiling on the host's CPUs is most of the time).
#   bash bench/results/2026-12-03-h200/session16/kval.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
KVAL_PARALLEL=1 KVAL_STEP_S=${KVAL_STEP_S:-420} \
  KVAL_STEPS="sweep-m192 sweep-fused192 sweep-fusedlanes" \
  bash scripts/kernel_validation.sh "$out/kval" 500
