#!/usr/bin/env bash
# Session 18, third call: the new default (ION_VEC_STRADDLE=auto: the 16-byte straddle copy
# on plans with a straddling fresh tile) under the cache-tail check, three 500-case fused
# sweeps (64/128/192-row tiles; every case planned by the default, so straddling cases run
# the 16-byte kernels: summary "cases_vec_straddle"), and suite "engine" with the backends
# in another order than in the first two calls (is the 16-byte kernels' 1-3% on aligned
# steps an order effect of the interleaved timing?).
#   . .gpu/cute/env.sh && . /tmp/ion-gpu/env.sh && bash bench/results/2026-12-03-h200/session18/next3.sh $OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 150 python3 scripts/cache_tail_check.py --out "$out/cache_tail" > "$out/cache_tail.log" 2>&1
echo "cache_tail rc=$?"; tail -9 "$out/cache_tail.log"
KVAL_PARALLEL=1 KVAL_STEP_S=${KVAL_STEP_S:-240} \
  KVAL_STEPS="sweep-fused192 sweep-fusedlanes sweep-fused128" \
  bash scripts/kernel_validation.sh "$out/kval" 500 > "$out/kval.log" 2>&1
echo "kval rc=$?"
for d in "$out"/kval/sweep-*/; do
  python3 - "$d" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "summary.json"))
print(sys.argv[1].split("/")[-2], s["passed"], "/", s["cases"], "max", s["max_rel_err"],
      "vec_straddle cases", s.get("cases_vec_straddle"), "split", s["cases_with_split_kv"])
PY
done
KB_BACKENDS=${KB_BACKENDS:-ion-auto-fused-vs,fa3,ion-auto-fused-novs,ion-auto-fused} \
  bash bench/results/2026-12-03-h200/session17/engine.sh "$out/engine"
tar czf "$out/engine-kb.tgz" -C "$out/engine" kb 2>/dev/null && rm -rf "$out/engine/kb"
