#!/usr/bin/env bash
# Session 19, vLLM call: the loop-invariant mask decision of the fused kernels
# (planner.fresh_mask_units) under the GPU tests of every fused kernel family, three
# 500-case fused sweeps (64/128/192-row tiles), then suite "engine" (16-byte and
# element-wise kernels, the auto default, FA3) and suite "anchors" (default against FA3).
#   . .gpu/cute/env.sh && . /tmp/ion-gpu/env.sh && python3 -m pip install ... . &&
#   bash bench/results/2026-12-03-h200/session19/next.sh $OUT/next
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
KVAL_PARALLEL=1 KVAL_STEP_S=${KVAL_STEP_S:-300} KVAL_PYTEST_SHARDS=4 \
  KVAL_PYTEST_FILES="tests/test_fused_writeback_gpu.py tests/test_vec_straddle_gpu.py
    tests/test_three_consumers_gpu.py tests/test_unpacked_split_gpu.py
    tests/test_unpacked_prefill_gpu.py tests/test_two_consumers_gpu.py
    tests/test_kv_stages_gpu.py tests/test_plan_repage_gpu.py tests/test_batch_invariance_gpu.py" \
  KVAL_STEPS="pytest-gpu sweep-fused192 sweep-fusedlanes sweep-fused128" \
  bash scripts/kernel_validation.sh "$out/kval" 500 > "$out/kval.log" 2>&1
echo "kval rc=$?"
grep -h -E "passed|failed|error" "$out"/kval/pytest-gpu-shard.*.log 2>/dev/null | tail -4
for d in "$out"/kval/sweep-*/; do
  python3 - "$d" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "summary.json"))
print(sys.argv[1].split("/")[-2], s["passed"], "/", s["cases"], "max", s["max_rel_err"],
      "vec_straddle cases", s.get("cases_vec_straddle"), "split", s["cases_with_split_kv"])
PY
done
KB_S=200 KB_BACKENDS=ion-auto-fused,fa3,ion-auto-fused-vs,ion-auto-fused-novs \
  bash bench/results/2026-12-03-h200/session17/engine.sh "$out/engine"
timeout 150 python3 -m ion_vllm.bench.cli kernel --suite anchors --backends ion-auto-fused,fa3 \
  --timing interleaved --out "$out/anchors" > "$out/anchors.log" 2>&1
echo "anchors rc=$?"; cat "$out/anchors/table.md" 2>/dev/null | head -30
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")" && rm -rf "$out" && echo "packed $out.tgz"
