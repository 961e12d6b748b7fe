#!/usr/bin/env bash
# GPU evidence for the reliability and model-coverage issues (one Hopper GPU, CuTeDSL +
# vLLM bundles, ion-vllm installed from this checkout).  A stage leaves one archive,
# OUT/<stage>.tgz (a device call brings back only a few files); show.py prints its verdicts.
#   bash bench/results/2026-12-07-h200/run.sh kernel OUT TAG_TREE   # ~9.5 min
#   bash bench/results/2026-12-07-h200/run.sh serve  OUT            # ~9.5 min
#   bash bench/results/2026-12-07-h200/run.sh all    OUT TAG_TREE   # both, cut short: ~8.5 min
#   bash bench/results/2026-12-07-h200/run.sh recheck OUT           # racecheck alone, and
#        the kernel stage's cut test shard (SANITIZE_SEED / SANITIZE_SHARD, RECHECK_RACE_S)
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# Parts:
# tests:    the GPU tests other than the 1344-case kernel matrix (the randomized sweep covers
#           those shapes): int32 offsets, 10-run repeats, the 224 model-feature cases, CUDA
#           graphs, the kernel cache, speculative-decoding rows, kv_append, the KV tier and
#           the sweep's own tests; beside them a 4000-case sweep (2000 per default path, a
#           third at head size 256, a quarter each with a window, sinks or a soft cap).
# bench:    interleaved in one process, on a quiet GPU: the anchor suite of this checkout
#           against the tag, and the model-feature A/B against FA3.
# soak:     scripts/serve_soak.py on the demo model: 3 rounds of 2000 mixed requests then
#           200 under memory pressure, 256 concurrent clients, 5% hang up mid-stream; half
#           the GPU's memory; GPU memory judged on the server's own processes.
# sanitize: compute-sanitizer memcheck, racecheck and synccheck (gpu_session.sh, step
#           sanitize) over every 7th case of a 108-case sweep (16 cases: both paths, every
#           tile size, split-KV and its combine, 16 of the 18 (G, head size) pairs) and over
#           kv_append and KV-tier GPU tests (the append kernel at d128 and d256, the tier's
#           ring gather kernel).
# kernel = tests then bench; serve = soak with sanitize beside it, once the server is up
# (vLLM's start-up memory profile fails when another process frees GPU memory during it);
# all = the soak, then, once its server is up, tests and sanitize beside it, then bench.
set -euo pipefail
stage=${1:?usage: run.sh kernel|serve|all|recheck OUT [TAG_TREE]}
out=${2:?usage: run.sh kernel|serve|all|recheck OUT [TAG_TREE]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
mkdir -p "$out/$stage"
dir=$out/$stage
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
k=tests/test_kernel_gpu.py a=tests/test_kv_append.py t=tests/test_kv_tier_gpu.py

tests() {  # tests DEADLINE_S
  SESSION_STEPS=kval KVAL_KV_TIER=1 KVAL_CASES=4000 KVAL_SWEEP_SHARDS=8 SESSION_DEADLINE_S=$1 \
  KVAL_SWEEP_BUDGET_S=$(( $1 - 45 )) \
  KVAL_TESTS="$k::test_cache_past_int32_offsets $k::test_split_kv_repeats_bit_identically
    $k::test_model_features_match_reference $k::test_cuda_graph_replays_new_batches
    $k::test_kernels_loaded_from_the_cache_run_right $k::test_plan_from_lengths_ahead_of_the_device
    $k::test_token_output_is_batch_invariant $k::test_speculative_decode_rows_match_reference
    $a $t tests/test_gpu_sweep.py" \
    bash "$root/scripts/gpu_session.sh" "$dir/tests" || true
}
bench() {  # bench DEADLINE_S
  TAG_TREE=$tag SESSION_STEPS=kbench SESSION_DEADLINE_S=$1 KBENCH_SUITES="anchors features" \
  KBENCH_BACKENDS=tag-ion,ion,tag-ion-attn,ion-attn,fa3,fa3-layer \
  KBENCH_REGISTER=$root/bench/results/2026-12-07-h100/consolidation/tag_backends.py \
    bash "$root/scripts/gpu_session.sh" "$dir/bench" || true
}
soak_start() {  # soak_start TIME_BUDGET_S; then waits until the server is up
  (cd "$root" && { [ -f bench/demo-model/config.json ] \
                   || python3 scripts/make_demo_model.py bench/demo-model; } \
   && python3 scripts/serve_soak.py --model bench/demo-model --out "$dir/soak" --rounds 3 \
        --pressure-requests "${SOAK_PRESSURE_REQUESTS:-200}" --time-budget "$1" \
        --gpu-memory-utilization 0.5) > "$dir/soak.log" 2>&1 &
  soak=$!
  until grep -qs "Application startup complete" "$dir/soak/serve.log" \
      || ! kill -0 "$soak" 2> /dev/null || [ "$(left 300)" -le 0 ]; do sleep 2; done
}
sanitize() {  # sanitize DEADLINE_S
  SESSION_STEPS=sanitize SANITIZE_CASES=108 SANITIZE_SHARD=${SANITIZE_SHARD:-0/7} \
  SANITIZE_BUDGET_S=$(( $1 - 90 )) SESSION_DEADLINE_S=$1 \
  SANITIZE_TESTS="$a::test_kv_append_matches_reference[128-idx_dtype0-dtype0]
    $a::test_kv_append_matches_reference[256-idx_dtype1-dtype1]
    $a::test_kv_append_single_token_and_empty $t::test_store_load_roundtrip
    $t::test_random_ops_cuda[ion-batch]" \
    bash "$root/scripts/gpu_session.sh" "$dir/sanitize" || true
}
recheck() {  # recheck DEADLINE_S: racecheck alone on the serve stage's sweep cases, then
  # the test shard the kernel stage's time limit cut (its 37 tests, a line each)
  SESSION_STEPS=sanitize SANITIZE_TOOLS=racecheck SANITIZE_CASES=108 \
  SANITIZE_SHARD=${SANITIZE_SHARD:-0/7} SANITIZE_SEED=${SANITIZE_SEED:-1389026906} \
  SANITIZE_TESTS=none SANITIZE_BUDGET_S=${RECHECK_RACE_S:-200} \
  SESSION_DEADLINE_S=$(( ${RECHECK_RACE_S:-200} + 60 )) \
    bash "$root/scripts/gpu_session.sh" "$dir/racecheck" || true
  local ids="" tile path kind
  for tile in 64 128 192; do for path in append fused; do
    for kind in chunks decode mixed split; do
      ids="$ids $k::test_model_features_match_reference[cap-bites-$tile-$path-$kind]"
    done
  done; done
  SESSION_STEPS=kval KVAL_SHARDS=4 KVAL_SWEEP_SHARDS=0 SESSION_DEADLINE_S=$(left "$1") \
  KVAL_TESTS="tests/test_gpu_sweep.py $k::test_cache_past_int32_offsets
    $k::test_cuda_graph_replays_new_batches $k::test_kernels_loaded_from_the_cache_run_right
    $k::test_model_features_match_reference[gemma2-128-append-chunks] $ids" \
    bash "$root/scripts/gpu_session.sh" "$dir/tests" || true
}
case $stage in
  recheck)
    recheck "${RECHECK_S:-470}" ;;
  kernel)
    tag=$(cd "${3:?kernel needs TAG_TREE}" && pwd)
    tests 360
    bench "$(left 570)" ;;
  serve)
    # a cold host's server start-up took 224 s on the H200: three rounds need the rest
    soak_start "${SOAK_S:-540}"
    sanitize "$(left 560)"
    wait "$soak" || true ;;
  all)
    tag=$(cd "${3:?all needs TAG_TREE}" && pwd)
    soak_start "${SOAK_S:-400}"
    tests "$(left 330)" &
    sanitize "$(left 350)" &
    wait ;;  # the soak, the tests and the sanitizer
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
if [ "$stage" = all ]; then
  bench "$(left "${ALL_S:-500}")"
fi
tar czf "$out/$stage.tgz" -C "$out" "$stage" && rm -rf "${out:?}/$stage"
