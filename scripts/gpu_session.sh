#!/usr/bin/env bash
# One GPU session's evidence as one chain that may outlive a 10-minute device command:
#   setsid nohup scripts/gpu_session.sh OUT > OUT.log 2>&1 &     # then poll OUT/steps.txt
# Steps (SESSION_STEPS, space-separated, run in this order; default "kval kbench startup e2e"):
#   kval     the kernel GPU tests (pytest -m gpu over KVAL_TESTS, default tests; the KV
#            tier's too with KVAL_KV_TIER=1,
#            instead of step kvgpu after it) in KVAL_SHARDS (8)
#            processes of contiguous test ids, and the randomized sweep against the
#            reference (KVAL_CASES, default 1000, one seed) in KVAL_SWEEP_SHARDS (4)
#            processes, all side by side: they are bound by compiling kernels on the CPU;
#            KVAL_SWEEP_BUDGET_S: a shard starts no case after that many seconds
#   kbench   ion-bench kernel, interleaved, one process: KBENCH_SUITES (anchors) x
#            KBENCH_BACKENDS (ion,ion-attn,ion-append,fa3,fa3-layer); KBENCH_REGISTER=FILE.py
#            registers more backends first (e.g. another checkout's kernels)
#   e2e      ion-bench e2e --serve --colocate: E2E_WORKLOADS (seed,skewed) x E2E_BACKENDS
#            (ION,FLASH_ATTN; NAME@DIR runs NAME with DIR's packages), E2E_REPEATS (2),
#            E2E_KV_GIB (29) per server, E2E_BUDGET_S (900)
#   startup  ion-bench startup: STARTUP_BACKENDS (ION,FLASH_ATTN), STARTUP_REPEATS (1),
#            STARTUP_COLD (kernels; all: no prime start, every cache cold), STARTUP_ARGS
#            (passed to vllm serve), STARTUP_S (2400)
#   agree    scripts/e2e_agreement.py on the tiny real-weight model (AGREE_ARGS)
#   models   per MODELS_ARCHS (gpt-oss gemma2 gemma3 mistral): a few-layer real-weight model
#            of that family (make_tiny_model.py --arch), `vllm serve` on ION starts and
#            answers (serve_check.sh), and e2e_agreement.py on it; then e2e_agreement.py
#            --spec-ngram MODELS_SPEC (3) on the tiny Qwen2 (0: none).  OUT/models/<arch>/
#   kvgpu    the KV tier's GPU tests (tests/test_kv_tier_gpu.py)
#   kvtier   scripts/kv_tier_bench.py --colocate (KVTIER_CONFIGS native-default,ion,none,
#            KVTIER_REPEATS 3, KVTIER_S 720, KVTIER_ARGS); cut short, its finished repeats
#            are rebuilt into results (--from-repeats)
#   preempt  scripts/kv_tier_preempt_check.py in float32 on TRITON_ATTN (tiny model)
#   sanitize compute-sanitizer, one run per tool (SANITIZE_TOOLS: memcheck racecheck
#            synccheck) over a reduced sweep of every default kernel (SANITIZE_CASES, 96:
#            each G, head size, path and tile size twice; KV <= 4096 tokens; split-KV and
#            combine every 4th case; SANITIZE_SHARD K/N runs every N-th of them,
#            SANITIZE_BUDGET_S stops starting cases after that many seconds, SANITIZE_SEED
#            replays a seed) and over the kv_append and KV-tier GPU tests (SANITIZE_TESTS:
#            the gather/drain kernels; "none": the sweep only);
#            torch's caching allocator off, so memcheck sees each tensor's own bounds; API
#            errors not reported, cuBLAS's nvjet GEMMs not instrumented.  Logs:
#            OUT/sanitize/<tool>-{sweep,tests}.log
# Models: MODEL (served; default bench/demo-model, made when missing), TINY_MODEL (default
# bench/models/tiny-qwen2, made when missing).
# A failed step does not stop the chain.  SESSION_DEADLINE_S: the chain's wall budget; each
# step's limit is cut to what is left minus 15 s, and a step with under 30 s left is skipped.
# SESSION_DRY_RUN=1 records each step's command in steps.txt instead of running it.
# The chain runs from a copy of the code (cute_kernels ion_vllm scripts tests) in a temporary
# dir it removes when it ends, so that a device call re-syncing the checkout never replaces a
# file a running step reads (SESSION_SNAPSHOT=0: run from the checkout).
# Exits 3 (reason in steps.txt) when a step's imports (vllm, cutlass) are missing.
# Results: OUT/steps.txt, OUT/<step>.log, OUT/<step>/.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: scripts/gpu_session.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
steps=${SESSION_STEPS-kval kbench e2e startup}
model=${MODEL:-$root/bench/demo-model}
tiny=${TINY_MODEL:-$root/bench/models/tiny-qwen2}
deadline=${SESSION_DEADLINE_S:-0}
dry=${SESSION_DRY_RUN:-0}
t0=$(date +%s)
: > "$out/steps.txt"

want() { [[ " $steps " == *" $1 "* ]]; }
mark() { printf '%s %-12s %s\n' "$(date -u +%H:%M:%S)" "$1" "$2" >> "$out/steps.txt"; }
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  if [ "$deadline" -gt 0 ]; then
    local left=$(( deadline - ($(date +%s) - t0) - 15 ))
    if [ "$left" -lt 30 ]; then
      mark "$name" "skipped: SESSION_DEADLINE_S=$deadline leaves ${left} s"
      return
    fi
    if [ "$left" -lt "$secs" ]; then
      mark "$name" "limit ${secs} s cut to ${left} s by SESSION_DEADLINE_S=$deadline"
      secs=$left
    fi
  fi
  if [ "$dry" = 1 ]; then
    mark "$name" "would run (limit ${secs} s): $*"
    return
  fi
  mark "$name" "start: $*"
  # every log line gets a UTC time stamp, so that overlapping steps can be told apart
  timeout "$secs" "$@" 2>&1 | while IFS= read -r l; do printf '%s %s\n' "$(date -u +%T)" "$l"; done \
    > "$out/$name.log"
  mark "$name" "rc=${PIPESTATUS[0]}"
}

# scratch space (the code snapshot, per-step CuTeDSL caches), removed however the chain ends
scratch=$(mktemp -d "${TMPDIR:-/tmp}/ion-session.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
trap 'exit 143' TERM INT
if [ "${SESSION_SNAPSHOT:-1}" = 1 ]; then
  mkdir "$scratch/src"
  for p in cute_kernels ion_vllm scripts tests setup.py pytest.ini; do
    [ -e "$root/$p" ] && cp -r "$root/$p" "$scratch/src/"
  done
  mark snapshot "$(cd "$scratch/src" && echo *)"
  cd "$scratch/src"
else
  cd "$root"
fi

need_vllm=0 need_cute=0
for s in e2e startup agree models kvgpu kvtier preempt; do want "$s" && need_vllm=1; done
for s in kval kbench e2e startup agree models kvtier sanitize; do want "$s" && need_cute=1; done
missing=
if [ "$dry" != 1 ]; then
  [ "$need_vllm" = 1 ] && ! python3 -c "import vllm" > /dev/null 2>&1 && missing="$missing vllm"
  [ "$need_cute" = 1 ] && ! python3 -c "import cutlass" > /dev/null 2>&1 && missing="$missing cutlass"
fi
if [ -n "$missing" ]; then
  mark preflight "not importable:$missing"
  mark all done
  exit 3
fi
if [ -z "${MODEL:-}" ] && [ ! -f "$model/config.json" ] \
    && { want e2e || want startup || want kvtier; }; then
  step model 120 python3 scripts/make_demo_model.py "$model"
fi
if [ -z "${TINY_MODEL:-}" ] && [ ! -f "$tiny/config.json" ] \
    && { want preempt || want agree || { want models && [ "${MODELS_SPEC:-3}" != 0 ]; }; }; then
  step tiny 180 python3 scripts/make_tiny_model.py "$tiny"
fi

if want kval; then
  # contiguous shards of the sorted test ids share few kernel options, so the shards
  # compile mostly disjoint sets of kernels
  ignore=--ignore=tests/test_kv_tier_gpu.py; [ "${KVAL_KV_TIER:-0}" = 1 ] && ignore=
  # shellcheck disable=SC2086  # KVAL_TESTS is a list of paths, ignore empty or one flag
  python3 -m pytest -q -m gpu --collect-only -p no:cacheprovider ${KVAL_TESTS:-tests} $ignore \
    > "$scratch/kval-collect.txt" 2>&1
  collect_rc=$?
  # test ids only (pytest's "ERROR: not found: x.py::y" lines hold '::' too)
  grep -E '^[^ ]+\.py::' "$scratch/kval-collect.txt" | sort > "$scratch/kval-tests.txt"
  # a bad id in KVAL_TESTS makes pytest collect nothing; never fall back to "every test"
  if [ "$collect_rc" -ne 0 ] || [ ! -s "$scratch/kval-tests.txt" ]; then
    mark kval-tests "refused: collection rc=$collect_rc, $(wc -l < "$scratch/kval-tests.txt") ids"
    cp "$scratch/kval-collect.txt" "$out/kval-collect.log"
    : > "$scratch/kval-tests.txt"
  fi
  shards=${KVAL_SHARDS:-8}
  split -n "l/$shards" -d -a 2 "$scratch/kval-tests.txt" "$scratch/kval-shard-"
  for f in "$scratch"/kval-shard-*; do
    [ -s "$f" ] || continue  # an empty shard would run pytest over the whole tree
    # shellcheck disable=SC2046  # one test id per word
    # -v: a line a test, so that a shard cut by its time limit still shows how far it got
    step "kval-tests-${f##*-}" 900 python3 -m pytest -m gpu -v --durations=5 \
      -p no:cacheprovider $(cat "$f") &
  done
  seed=$(python3 -c 'import time; print(time.time_ns() % 2**31)')
  n=${KVAL_SWEEP_SHARDS:-4}  # 0: no sweep
  for ((i = 0; i < n; i++)); do
    CUTE_DSL_DISABLE_FILE_CACHING=1 step "sweep-$i" 900 python3 scripts/gpu_sweep.py \
      --cases "${KVAL_CASES:-1000}" --seed "$seed" --shard "$i/$n" --quiet \
      --time-budget "${KVAL_SWEEP_BUDGET_S:-0}" \
      --out "$out/sweep-$i" &
  done
  wait
fi
if want kbench; then
  reg=; [ -n "${KBENCH_REGISTER:-}" ] && reg="--register ${KBENCH_REGISTER}"
  suites=; for s in ${KBENCH_SUITES:-anchors}; do suites="$suites --suite $s"; done
  # shellcheck disable=SC2086  # reg and suites are lists of flags
  step kbench 600 python3 -m ion_vllm.bench.cli kernel $suites $reg \
    --backends "${KBENCH_BACKENDS:-ion,ion-attn,ion-append,fa3,fa3-layer}" \
    --timing interleaved --out "$out/kbench"
fi
if want startup; then
  # shellcheck disable=SC2086  # STARTUP_ARGS is a list of vllm serve flags
  step startup "${STARTUP_S:-2400}" python3 -m ion_vllm.bench.cli startup \
    --backends "${STARTUP_BACKENDS:-ION,FLASH_ATTN}" --repeats "${STARTUP_REPEATS:-1}" \
    --cold "${STARTUP_COLD:-kernels}" \
    --model "$model" --out "$out/startup" ${STARTUP_ARGS:-}
fi
if want e2e; then
  step e2e "$(( ${E2E_BUDGET_S:-900} + 300 ))" python3 -m ion_vllm.bench.cli e2e --serve \
    --colocate --workload "${E2E_WORKLOADS:-seed,skewed}" --backends "${E2E_BACKENDS:-ION,FLASH_ATTN}" \
    --repeats "${E2E_REPEATS:-2}" --kv-cache-gib "${E2E_KV_GIB:-29}" \
    --time-budget "${E2E_BUDGET_S:-900}" --model "$model" --out "$out/e2e"
fi
if want agree; then
  # shellcheck disable=SC2086
  step agree 900 python3 scripts/e2e_agreement.py --model "$tiny" --out "$out/agree" ${AGREE_ARGS:-}
fi
if want models; then
  for arch in ${MODELS_ARCHS:-gpt-oss gemma2 gemma3 mistral}; do
    dir="$out/models/$arch" m="$scratch/models/$arch"
    mkdir -p "$dir"
    step "model-$arch" 180 python3 scripts/make_tiny_model.py "$m" --arch "$arch"
    step "serve-$arch" 420 bash scripts/serve_check.sh "$m" "$dir/serve"
    step "agree-$arch" 900 python3 scripts/e2e_agreement.py --model "$m" --out "$dir/agree"
  done
  if [ "${MODELS_SPEC:-3}" != 0 ]; then
    step agree-spec 900 python3 scripts/e2e_agreement.py --model "$tiny" \
      --spec-ngram "${MODELS_SPEC:-3}" --out "$out/models/spec-ngram"
  fi
fi
if want kvgpu; then
  step kvgpu 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kv_tier_gpu.py
fi
if want kvtier; then
  # shellcheck disable=SC2086  # KVTIER_ARGS is a list of flags
  step kvtier "${KVTIER_S:-720}" python3 scripts/kv_tier_bench.py "$model" --colocate \
    --repeats "${KVTIER_REPEATS:-3}" --configs "${KVTIER_CONFIGS:-native-default,ion,none}" \
    ${KVTIER_ARGS:-} --out "$out/kvtier"
  if [ "$dry" != 1 ] && ! grep -q "kvtier       rc=0" "$out/steps.txt" \
      && [ -s "$out/kvtier/repeats.jsonl" ]; then
    timeout 30 python3 scripts/kv_tier_bench.py --from-repeats "$out/kvtier" \
      > "$out/kvtier-rebuild.log" 2>&1
    mark kvtier "rebuilt from repeats.jsonl: rc=$?"
  fi
fi
if want preempt; then
  mkdir -p "$out/preempt"
  step preempt 300 python3 scripts/kv_tier_preempt_check.py "$tiny" --enforce-eager \
    --attention-backend TRITON_ATTN --dtype float32 --no-batch-invariant --parallel --verify \
    --out "$out/preempt/preempt_check_fp32_triton.json"
fi
if want sanitize; then
  mkdir -p "$out/sanitize"
  seed=${SANITIZE_SEED:-$(python3 -c 'import time; print(time.time_ns() % 2**31)')}
  # the tools run side by side (each run is bound by the sanitizer's slow kernels, not by
  # the GPU's capacity); kernels come from ION_KERNEL_CACHE when an earlier step built them
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    # device-side errors only (cuda-python's driver bindings probe cuGetProcAddress at
    # import, which memcheck reports as API errors); cuBLAS's own GEMMs (the reference's
    # nvjet kernels) are not ours to check
    san=(compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all
         --report-api-errors no --kernel-name-exclude kns=nvjet)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 CUTE_DSL_DISABLE_FILE_CACHING=1 step "san-$tool-sweep" 900 \
      "${san[@]}" --log-file "$out/sanitize/$tool-sweep.log" python3 scripts/gpu_sweep.py \
      --cases "${SANITIZE_CASES:-96}" --shard "${SANITIZE_SHARD:-0/1}" --seed "$seed" \
      --max-kv-tokens 4096 --time-budget "${SANITIZE_BUDGET_S:-0}" --quiet \
      --out "$out/sanitize/$tool-sweep" &
    # shellcheck disable=SC2086  # SANITIZE_TESTS is a list of test ids
    [ "${SANITIZE_TESTS:-}" = none ] \
      || PYTORCH_NO_CUDA_MEMORY_CACHING=1 step "san-$tool-tests" 900 \
      "${san[@]}" --log-file "$out/sanitize/$tool-tests.log" python3 -m pytest -m gpu -q \
      -p no:cacheprovider ${SANITIZE_TESTS:-tests/test_kv_append.py tests/test_kv_tier_gpu.py} &
  done
  wait
fi
mark all done
