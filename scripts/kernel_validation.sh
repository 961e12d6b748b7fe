#!/usr/bin/env bash
# Validate every IonAttention kernel path on a Hopper GPU in one go. It runs:
#   1. the GPU pytest files of the kernels (batch invariance, fused writeback, unpacked
#      prefill tiles, two consumer warpgroups, kv_append, row combine, 128-token pages);
#   2. the randomized sweep against the fp32 reference, --cases N per path (default 500),
#      with every 4th case forcing split-KV: append (the default), fused writeback, unpacked,
#      128-row tiles on two consumer warpgroups (with unpacked prefill), the row-parallel
#      split-KV combine (every 2nd case forced to split), the lazy-rescaling kernels, and the
#      combine launched by programmatic dependent launch (workspace NaN-poisoned), and fused
#      writeback on 128-row tiles, and the split-parallel combine, and the experiments on
#      128-row tiles (page pairs, two K/V stages, warpgroup ping-pong) and the pinned PV
#      wait (64-row and fused 128-row), plain and fused; the 192-row (three consumer
#      warpgroups) kernels with the v18 split of unpacked tiles, plain and fused, and the
#      backend's default 64-row form (fused, unpacked, split-parallel combine);
#   3. the anchor A/B: ion, ion-unpacked, ion-m128(-unpacked) and FA3 in one ion-bench run.
# Steps 1-2 only check correctness, and most of their wall time is CuTeDSL compiling on the
# CPU, so with KVAL_PARALLEL=1 they run side by side (each with its own CuTeDSL cache dir, so
# no two processes write one cache). Step 3 times kernels and always runs alone, afterwards.
# KVAL_STEP_S caps each correctness step (default 600 s), KVAL_BENCH_S the A/B (600 s).
# KVAL_STEPS (space-separated step names) runs a subset; KVAL_BACKENDS sets the A/B's backends.
# KVAL_PYTEST_SHARDS=N splits pytest-gpu over N processes (it is CPU-compile bound).
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
  printf '%-16s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" > "$out/$name.step"
  cat "$out/$name.step"
  tail -4 "$out/$name.log"
}

step_s=${KVAL_STEP_S:-600}
bench_s=${KVAL_BENCH_S:-600}
cache_root=${CUTE_DSL_CACHE_DIR:-/tmp/ion-cute-cache}
# sweeps stop starting cases 60 s before their step's limit, so each still writes a summary
budget=$(( step_s > 120 ? step_s - 60 : step_s / 2 ))
# KVAL_PYTEST_FILES (space-separated) narrows pytest-gpu to some files, e.g. only the tests
# of what changed since the last full run (the full list takes ~6 min, CPU-compile bound)
pytest_files=${KVAL_PYTEST_FILES:-"tests/test_batch_invariance_gpu.py
     tests/test_fused_writeback_gpu.py tests/test_unpacked_prefill_gpu.py
     tests/test_two_consumers_gpu.py tests/test_kv_append.py tests/test_row_combine_gpu.py
     tests/test_page128_gpu.py tests/test_lazy_rescale_gpu.py tests/test_pdl_combine_gpu.py
     tests/test_lane_combine_gpu.py tests/test_kv_pair_gpu.py tests/test_kv_stages_gpu.py
     tests/test_pingpong_gpu.py tests/test_pin_pv_wait_gpu.py tests/test_plan_repage_gpu.py"}
# KVAL_PYTEST_SHARDS=N runs pytest-gpu as N pytest processes side by side
# (scripts/pytest_gpu_shards.sh; logs $out/pytest-gpu-shard.<i>.log)
if [ "${KVAL_PYTEST_SHARDS:-1}" -gt 1 ]; then
  pytest_cmd="bash scripts/pytest_gpu_shards.sh $KVAL_PYTEST_SHARDS $out/pytest-gpu-shard $pytest_files"
else
  pytest_cmd="python3 -m pytest -m gpu -q -p no:cacheprovider $pytest_files"
fi
checks=(
  "pytest-gpu $pytest_cmd"
  "sweep-append python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet --out $out/sweep-append"
  "sweep-fused python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet --path fused
     --out $out/sweep-fused"
  "sweep-unpacked python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet --unpacked-prefill
     --out $out/sweep-unpacked"
  "sweep-m128 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet --tile-m 128
     --unpacked-prefill --out $out/sweep-m128"
  "sweep-rowcomb python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --row-combine --force-split-every 2 --out $out/sweep-rowcomb"
  "sweep-lazy python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --row-combine --lazy-rescale --force-split-every 2
     --out $out/sweep-lazy"
  "sweep-pdl python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --row-combine --pdl-combine --force-split-every 2
     --out $out/sweep-pdl"
  "sweep-fused128 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 128 --unpacked-prefill --row-combine --force-split-every 2
     --out $out/sweep-fused128"
  "sweep-lanes python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --lane-combine --force-split-every 2
     --out $out/sweep-lanes"
  "sweep-kvpair python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --lane-combine --kv-pair --force-split-every 2
     --out $out/sweep-kvpair"
  "sweep-fusedkp python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 128 --unpacked-prefill --lane-combine --kv-pair --force-split-every 2
     --out $out/sweep-fusedkp"
  "sweep-s2 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --lane-combine --kv-stages 2 --force-split-every 2
     --out $out/sweep-s2"
  "sweep-fuseds2 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 128 --unpacked-prefill --lane-combine --kv-stages 2
     --force-split-every 2 --out $out/sweep-fuseds2"
  "sweep-pp python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 128 --unpacked-prefill --lane-combine --pingpong on --force-split-every 2
     --out $out/sweep-pp"
  "sweep-fusedpp python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 128 --unpacked-prefill --lane-combine --pingpong on
     --force-split-every 2 --out $out/sweep-fusedpp"
  "sweep-m192 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --tile-m 192 --unpacked-prefill --lane-combine --force-split-every 2
     --out $out/sweep-m192"
  "sweep-fused192 python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 192 --unpacked-prefill --lane-combine --force-split-every 2
     --out $out/sweep-fused192"
  "sweep-fusedlanes python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --unpacked-prefill --lane-combine --force-split-every 2
     --out $out/sweep-fusedlanes"
  "sweep-pin python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --unpacked-prefill --lane-combine --pin-pv-wait on --force-split-every 2
     --out $out/sweep-pin"
  "sweep-fusedpin python3 scripts/gpu_sweep.py --cases $cases --time-budget $budget --quiet
     --path fused --tile-m 128 --unpacked-prefill --lane-combine --pin-pv-wait on
     --force-split-every 2 --out $out/sweep-fusedpin"
)
pids=()
for c in "${checks[@]}"; do
  read -r -a argv <<< "$(echo $c)"
  name=${argv[0]}
  # KVAL_STEPS="pytest-gpu sweep-fused ...": run only those steps (default: all)
  if [ -n "${KVAL_STEPS:-}" ] && [[ " $KVAL_STEPS " != *" $name "* ]]; then continue; fi
  if [ "${KVAL_PARALLEL:-0}" = 1 ]; then
    CUTE_DSL_CACHE_DIR="$cache_root-$name" step "$name" "$step_s" "${argv[@]:1}" &
    pids+=($!)
  else
    step "$name" "$step_s" "${argv[@]:1}"
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
if [ -z "${KVAL_STEPS:-}" ] || [[ " $KVAL_STEPS " == *" bench-anchors "* ]]; then
  step bench-anchors "$bench_s" python3 -m ion_vllm.bench.cli kernel --suite anchors \
    --backends "${KVAL_BACKENDS:-ion,ion-auto,ion-auto-rc,ion-unpacked,ion-m128-unpacked,fa3}" \
    --out "$out/bench"
fi
for n in pytest-gpu sweep-append sweep-fused sweep-unpacked sweep-m128 sweep-rowcomb \
    sweep-lazy sweep-pdl sweep-fused128 sweep-lanes sweep-kvpair sweep-fusedkp \
    sweep-s2 sweep-fuseds2 sweep-pp sweep-fusedpp sweep-m192 sweep-fused192 sweep-fusedlanes \
    sweep-pin sweep-fusedpin bench-anchors; do
  cat "$out/$n.step" 2>/dev/null || printf '%-16s rc=%-3s %4ss\n' "$n" "-" "-"
done > "$out/steps.txt"

python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
lines = ["# Kernel validation", "", "```", open(os.path.join(out, "steps.txt")).read().rstrip(),
         "```", ""]
for name in ("sweep-append", "sweep-fused", "sweep-unpacked", "sweep-m128", "sweep-rowcomb",
             "sweep-lazy", "sweep-pdl", "sweep-fused128", "sweep-lanes", "sweep-kvpair",
             "sweep-fusedkp", "sweep-s2", "sweep-fuseds2", "sweep-pp", "sweep-fusedpp",
             "sweep-m192", "sweep-fused192", "sweep-fusedlanes", "sweep-pin", "sweep-fusedpin"):
    p = os.path.join(out, name, "summary.json")
    if os.path.exists(p):
        s = json.load(open(p))
        lines.append(f"- {name}: {s['verdict']} {s['passed']}/{s['cases']} (of {s.get('cases_planned')} planned), "
                     f"max rel err "
                     f"{s['max_rel_err']}, cases with split-KV {s.get('cases_with_split_kv')}, "
                     f"with unpacked tiles {s.get('cases_with_unpacked_tiles')}, "
                     f"with split unpacked tiles {s.get('cases_with_split_unpacked')}")
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
