#!/usr/bin/env bash
# Validate every IonAttention kernel path on a Hopper GPU in one go. It runs:
#   1. the GPU pytest files of the kernels (batch invariance, fused writeback, unpacked
#      prefill tiles, kv_append);
#   2. the randomized sweep against the fp32 reference, --cases N per path (default 500),
#      with every 4th case forcing split-KV: append (the default), fused writeback, unpacked,
#      and 128-row tiles on two consumer warpgroups (with unpacked prefill);
#   3. the anchor A/B: ion, ion-unpacked, ion-m128(-unpacked) and FA3 in one ion-bench run.
# Each step has its own time limit and the script keeps going after a failure.
# Run it on the GPU host with the project installed and CuTeDSL + vLLM importable.
#   scripts/kernel_validation.sh OUT_DIR [CASES]
# Results: OUT_DIR/{steps.txt,summary.md,*.log,sweep-*/,bench/} and OUT_DIR.tgz (everything).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: scripts/kernel_validation.sh OUT_DIR [CASES]}
cases=${2:-500}
mkdir -p "$out"
: > "$out/steps.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  # pytest exits 0 when every test was skipped (no Hopper GPU): that validates nothing
  if [ "$rc" -eq 0 ] && [ "$name" = pytest-gpu ] && ! grep -q " passed" "$out/$name.log"; then
    rc=5
  fi
  printf '%-16s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$out/steps.txt"
  tail -4 "$out/$name.log"
}

step pytest-gpu 900 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_batch_invariance_gpu.py tests/test_fused_writeback_gpu.py \
  tests/test_unpacked_prefill_gpu.py tests/test_two_consumers_gpu.py tests/test_kv_append.py
step sweep-append 600 python3 scripts/gpu_sweep.py --cases "$cases" --quiet \
  --out "$out/sweep-append"
step sweep-fused 600 python3 scripts/gpu_sweep.py --cases "$cases" --quiet --path fused \
  --out "$out/sweep-fused"
step sweep-unpacked 600 python3 scripts/gpu_sweep.py --cases "$cases" --quiet \
  --unpacked-prefill --out "$out/sweep-unpacked"
step sweep-m128 600 python3 scripts/gpu_sweep.py --cases "$cases" --quiet --tile-m 128 \
  --unpacked-prefill --out "$out/sweep-m128"
step bench-anchors 600 python3 -m ion_vllm.bench.cli kernel --suite anchors \
  --backends ion,ion-unpacked,ion-m128,ion-m128-unpacked,fa3 --out "$out/bench"

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
lines = ["# Kernel validation", "", "```", open(os.path.join(out, "steps.txt")).read().rstrip(),
         "```", ""]
for name in ("sweep-append", "sweep-fused", "sweep-unpacked", "sweep-m128"):
    p = os.path.join(out, name, "summary.json")
    if os.path.exists(p):
        s = json.load(open(p))
        lines.append(f"- {name}: {s['verdict']} {s['passed']}/{s['cases']}, max rel err "
                     f"{s['max_rel_err']}, cases with split-KV {s.get('cases_with_split_kv')}, "
                     f"with unpacked tiles {s.get('cases_with_unpacked_tiles')}")
    else:
        lines.append(f"- {name}: no summary")
t = os.path.join(out, "bench", "table.md")
if os.path.exists(t):
    lines += ["", open(t).read()]
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
echo "bundle: $out.tgz"
