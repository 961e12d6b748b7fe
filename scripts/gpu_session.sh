#!/usr/bin/env bash
# One device lease's worth of GPU evidence, run as a single background chain so that it can
# outlive the 10-minute limit of one command (start it with setsid, then poll OUT/steps.txt).
# Steps, in order (each with its own time limit; a failed step does not stop the chain):
#   kbench  kernel A/B on the anchor suite (alone on the GPU): ion-auto (the default
#           attention), ion-auto-fused (what a layer runs by default: fused KV writeback, one
#           launch), ion-auto-s2 / ion-auto-fused-s2 (the same with two K/V stages on
#           128-row tiles, the depth before 2026-12-02), fa3; interleaved timing
#   kvgpu   the KV tier's GPU tests (tests/test_kv_tier_gpu.py: random store/evict/load/flush
#           operations on CUDA streams, both copiers, every restore verified; a store/load
#           round trip; the ring's HBM bound)
#   preempt the KV tier's preemption check in float32 on TRITON_ATTN (tiny real-weight model,
#           /tmp/tiny): reference, tier (with block verification) and control run side by
#           side; fp32 rounding noise is too small to flip greedy near-ties, so the token
#           comparison is meaningful
#   kval    the kernel GPU tests + the lane-combine and page-pair (attention, fused)
#           500-case sweeps (KVAL_STEPS overrides the list)
#           (CPU-compile bound; the tests took 190 s before the 128-token-page file was
#           added); it runs while the e2e servers start up (~160 s): steps.txt and
#           e2e.log's time stamps show whether it ended before the first e2e bench run
#   e2e     ion-bench e2e --serve --colocate over every named workload, ION vs FLASH_ATTN,
#           2 repeats, interleaved A/B
#   kvtier  scripts/kv_tier_bench.py --colocate (ion, native-default, none: engines start
#           together, then, once all are up, measure one at a time, repeats interleaved)
#   kvtier2 a second kvtier run (KVTIER2_CONFIGS, KVTIER2_REPEATS, KVTIER2_S, KVTIER2_ARGS)
#   share   scripts/attention_share.py on the seed workload (SHARE_BACKENDS, default ION vs
#           FLASH_ATTN; ION variant labels such as ION+noreuse allowed; SHARE_KV_GIB each;
#           SHARE_ARGS extra flags, e.g. the skewed workload: "--input-len 4096
#           --output-len 512 --range-ratio 0.9 --num-prompts 128 --max-num-seqs 64
#           --profile-prompts 64")
#   agree   scripts/e2e_agreement.py on the tiny real-weight model (ION, TRITON_ATTN against
#           FLASH_ATTN), under vLLM's CUDA graphs unless AGREE_ARGS says otherwise; one run
#           per AGREE_MODES entry: "default" (FULL_AND_PIECEWISE) or a --ion-cudagraph-mode
# Environment: SESSION_STEPS (subset, space-separated; default kbench preempt e2e kvtier),
# SESSION_DEADLINE_S (the chain's wall budget; see below),
# KBENCH_BACKENDS, KBENCH_TIMING (interleaved, the default: backends alternate call by call; or queued), E2E_WORKLOADS (comma-separated, in run order),
# E2E_BACKENDS, E2E_BUDGET_S, E2E_KV_GIB (KV cache per colocated server, default 30; ion-bench
# refuses sizes that overcommit the GPU), KVTIER_CONFIGS, KVTIER_REPEATS, KVTIER_S, KVTIER_ARGS (extra
# kv_tier_bench.py arguments, e.g. "--max-tokens 256"), SHARE_S, AGREE_MODES (default
# "default FULL"), AGREE_ARGS, MODEL, DEMO_MODEL, TINY_MODEL.
# Preflight: exits 3 (steps.txt says why) when a step's imports (vllm, cutlass) are missing.
#   setsid nohup scripts/gpu_session.sh OUT > OUT.log 2>&1 &
# Results: OUT/{steps.txt,kbench/,preempt/,kval/,e2e/,kvtier/,share/} and OUT/<step>.log
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: scripts/gpu_session.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
# Run from a private copy of the checkout: every device call re-syncs the working tree, and
# a file replaced while CuTeDSL reads a kernel's source fails that compile (seen on
# 2026-12-01: one sweep case, "could not get source code" for a kernel method).
# SESSION_DEADLINE_S: the whole chain's wall budget in seconds, counted from this start
# (0 or unset: none).  Each step's limit is cut to what is left minus a 15 s margin, and a
# step with under 30 s left is skipped, so that a device call's own limit never kills the
# chain before the command after it (the tar of OUT) runs; the thirteenth session lost a
# call's results that way.
export ION_SESSION_T0=${ION_SESSION_T0:-$(date +%s)}
# The copy this script made is removed when the chain ends (a snapshot handed in by the
# caller through ION_SESSION_SNAPSHOT is the caller's and stays).
if [ -z "${ION_SESSION_SNAPSHOT:-}" ]; then
  snap=$(mktemp -d "${TMPDIR:-/tmp}/ion-session-src.XXXXXX")
  tar -C . --exclude=./.gpu --exclude=./.git -cf - . | tar -C "$snap" -xf -
  ION_SESSION_SNAPSHOT=$snap ION_SESSION_SNAPSHOT_OWNED=1 exec bash "$snap/scripts/gpu_session.sh" "$out"
fi
if [ "${ION_SESSION_SNAPSHOT_OWNED:-}" = 1 ]; then
  trap 'rm -rf -- "$ION_SESSION_SNAPSHOT"' EXIT
fi
unset ION_SESSION_SNAPSHOT_OWNED
# MODEL: the served model; unset, the offline demo model at DEMO_MODEL (default
# /tmp/ion-demo), made by scripts/make_demo_model.py when missing
model=${MODEL:-${DEMO_MODEL:-/tmp/ion-demo}}
tiny=${TINY_MODEL:-/tmp/tiny}
steps=${SESSION_STEPS:-kbench preempt e2e kvtier}
: > "$out/steps.txt"

want() { [[ " $steps " == *" $1 "* ]]; }
mark() { printf '%s %-8s %s\n' "$(date -u +%H:%M:%S)" "$1" "$2" >> "$out/steps.txt"; }
deadline=${SESSION_DEADLINE_S:-0}
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  if [ "$deadline" -gt 0 ]; then
    local left=$(( deadline - ($(date +%s) - ION_SESSION_T0) - 15 ))
    if [ "$left" -lt 30 ]; then
      mark "$name" "skipped: SESSION_DEADLINE_S=$deadline leaves ${left} s"
      return
    fi
    if [ "$left" -lt "$secs" ]; then
      mark "$name" "limit ${secs} s cut to ${left} s by SESSION_DEADLINE_S=$deadline"
      secs=$left
    fi
  fi
  mark "$name" "start: $*"
  # every log line gets a UTC time stamp, so that overlaps between steps can be checked
  timeout "$secs" "$@" 2>&1 | while IFS= read -r l; do printf '%s %s\n' "$(date -u +%T)" "$l"; done \
    > "$out/$name.log"
  mark "$name" "rc=${PIPESTATUS[0]}"
}

# Preflight: a device call that fails inside a step costs its start-up minutes, so check
# first that what the steps import is there (on the GPU host: `. .gpu/cute/env.sh`, with
# .gpu/cute carried, after the vLLM bundle was staged), and make the demo model if a step
# serves it and it is missing.
need_vllm=0
need_cute=0
for s in kvgpu preempt e2e kvtier kvtier2 share agree; do want "$s" && need_vllm=1; done
for s in kbench kval e2e kvtier kvtier2 share agree; do want "$s" && need_cute=1; done
missing=
[ "$need_vllm" = 1 ] && ! python3 -c "import vllm" > /dev/null 2>&1 && missing="$missing vllm"
[ "$need_cute" = 1 ] && ! python3 -c "import cutlass" > /dev/null 2>&1 && missing="$missing cutlass"
if [ -n "$missing" ]; then
  mark preflight "not importable:$missing (on the GPU host: . .gpu/cute/env.sh with .gpu/cute carried, after staging the vLLM bundle)"
  mark all done
  exit 3
fi
if [ -z "${MODEL:-}" ] && [ ! -f "$model/config.json" ] && { want e2e || want kvtier || want kvtier2 || want share; }; then
  step model 120 python3 scripts/make_demo_model.py "$model"
fi
# the tiny real-weight model of preempt / agree (a bare host has none: the twenty-first
# session's preempt step failed on a missing /tmp/tiny)
if [ -z "${TINY_MODEL:-}" ] && [ ! -f "$tiny/config.json" ] && { want preempt || want agree; }; then
  step tiny 180 python3 scripts/make_tiny_model.py "$tiny"
fi

if want kbench; then
  kb_default=ion-auto,ion-auto-s2,ion-auto-fused,ion-auto-fused-s2,fa3
  step kbench 240 python3 -m ion_vllm.bench.cli kernel --suite anchors \
    --backends "${KBENCH_BACKENDS:-$kb_default}" --timing "${KBENCH_TIMING:-interleaved}" \
    --out "$out/kbench"
fi
if want kvgpu; then
  step kvgpu 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kv_tier_gpu.py
fi
if want preempt; then
  mkdir -p "$out/preempt"
  step preempt 300 python3 scripts/kv_tier_preempt_check.py "$tiny" --enforce-eager \
    --attention-backend TRITON_ATTN --dtype float32 --no-batch-invariant --parallel --verify \
    --out "$out/preempt/preempt_check_fp32_triton.json"
fi
kval_pid=
if want kval; then
  KVAL_PARALLEL=1 KVAL_STEP_S=420 KVAL_STEPS="${KVAL_STEPS:-pytest-gpu sweep-lanes sweep-kvpair sweep-fusedkp}" \
    step kval 450 scripts/kernel_validation.sh "$out/kval" 500 &
  kval_pid=$!
fi
if want e2e; then
  step e2e "$(( ${E2E_BUDGET_S:-900} + 240 ))" python3 -m ion_vllm.bench.cli e2e --serve \
    --colocate --workload "${E2E_WORKLOADS:-seed,skewed,decode-heavy,shared-prefix,long}" \
    --backends "${E2E_BACKENDS:-ION,FLASH_ATTN}" --repeats 2 --kv-cache-gib "${E2E_KV_GIB:-30}" \
    --time-budget "${E2E_BUDGET_S:-900}" --model "$model" --out "$out/e2e"
fi
[ -n "$kval_pid" ] && wait "$kval_pid"
# kvtier_step NAME LIMIT_S REPEATS CONFIGS ARGS: one kv_tier_bench.py run into OUT/NAME; when
# cut short (step limit), the results of the repeats that finished (a second or two, so it
# runs outside the deadline's margin)
kvtier_step() {
  local name=$1 secs=$2 reps=$3 configs=$4 args=$5
  # shellcheck disable=SC2086  # ARGS is a list of flags
  step "$name" "$secs" python3 scripts/kv_tier_bench.py "$model" --colocate \
    --repeats "$reps" --configs "$configs" $args --out "$out/$name"
  if ! grep -q "$(printf '%-8s' "$name") rc=0" "$out/steps.txt" \
      && [ -s "$out/$name/repeats.jsonl" ]; then
    timeout 30 python3 scripts/kv_tier_bench.py --from-repeats "$out/$name" \
      > "$out/$name-rebuild.log" 2>&1
    mark "$name" "rebuilt from repeats.jsonl: rc=$?"
  fi
}
if want kvtier; then
  kvtier_step kvtier "${KVTIER_S:-720}" "${KVTIER_REPEATS:-3}" \
    "${KVTIER_CONFIGS:-ion,native-default,none}" "${KVTIER_ARGS:-}"
fi
# kvtier2: a second kv_tier_bench.py run after the first (its own engines), for a lease
# that A/Bs more configs than fit the GPU at once
if want kvtier2; then
  kvtier_step kvtier2 "${KVTIER2_S:-720}" "${KVTIER2_REPEATS:-3}" \
    "${KVTIER2_CONFIGS:-ion,native-default}" "${KVTIER2_ARGS:-}"
fi
if want share; then
  step share "${SHARE_S:-420}" python3 scripts/attention_share.py --model "$model" --colocate \
    --backends "${SHARE_BACKENDS:-ION,FLASH_ATTN}" --kv-cache-gib "${SHARE_KV_GIB:-30}" \
    ${SHARE_ARGS:-} --out "$out/share"
fi
if want agree; then
  for mode in ${AGREE_MODES:-default FULL}; do  # step names: agree-default, agree-FULL
    extra=; [ "$mode" = default ] || extra="--ion-cudagraph-mode $mode"
    step "agree-$mode" 420 python3 scripts/e2e_agreement.py --model "$tiny" \
      --out "$out/agree-$mode" $extra ${AGREE_ARGS:-}
  done
fi
mark all done
