#!/usr/bin/env bash
# GPU evidence for the reliability and model-coverage issues, in two device calls (each
# under 10 minutes; one Hopper GPU, CuTeDSL + vLLM bundles, ion-vllm installed from this
# checkout).  Each stage leaves one archive, OUT/<stage>.tgz (a device call brings back
# only a few files):
#   bash bench/results/2026-12-07-h200/run.sh kernel OUT TAG_TREE
#   bash bench/results/2026-12-07-h200/run.sh serve  OUT
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# kernel: the GPU tests other than the 1344-case kernel matrix (the randomized sweep covers
#         those shapes): int32 offsets, 10-run repeats, the 224 model-feature cases, CUDA
#         graphs, the kernel cache, speculative-decoding rows, kv_append, the KV tier and
#         the sweep's own tests; beside them a 4000-case sweep (2000 per default path, a
#         third at head size 256, a quarter each with a window, sinks or a soft cap); then,
#         interleaved in one process, the anchor suite of this checkout against the tag and
#         the model-feature A/B against FA3.
# serve:  two jobs side by side, each bound by something the other barely uses:
#         scripts/serve_soak.py on the demo model (3 rounds of 2000 mixed requests then 300
#         under memory pressure, 256 concurrent clients, 5% hang up mid-stream; half the
#         GPU's memory; GPU memory judged on the server's own processes) and, once the
#         server is up, compute-sanitizer memcheck, racecheck and synccheck (gpu_session.sh,
#         step sanitize) over every 7th case of a 108-case sweep (16 cases: both paths,
#         every tile size, split-KV and its combine, 16 of the 18 (G, head size) pairs)
#         and over kv_append and KV-tier GPU tests (the append kernel at d128 and d256, the
#         tier's ring gather kernel).
set -euo pipefail
stage=${1:?usage: run.sh kernel|serve OUT [TAG_TREE]}
out=${2:?usage: run.sh kernel|serve OUT [TAG_TREE]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
mkdir -p "$out"
case $stage in
  kernel)
    tag=$(cd "${3:?kernel needs TAG_TREE}" && pwd)
    k=tests/test_kernel_gpu.py
    TAG_TREE=$tag SESSION_STEPS="kval kbench" KVAL_KV_TIER=1 KVAL_CASES=4000 \
    KVAL_SWEEP_SHARDS=8 SESSION_DEADLINE_S=${SESSION_DEADLINE_S:-540} \
    KVAL_TESTS="$k::test_cache_past_int32_offsets $k::test_split_kv_repeats_bit_identically
      $k::test_model_features_match_reference $k::test_cuda_graph_replays_new_batches
      $k::test_kernels_loaded_from_the_cache_run_right $k::test_plan_from_lengths_ahead_of_the_device
      $k::test_token_output_is_batch_invariant $k::test_speculative_decode_rows_match_reference
      tests/test_kv_append.py tests/test_kv_tier_gpu.py
      tests/test_gpu_sweep.py" \
    KBENCH_SUITES="anchors features" KBENCH_BACKENDS=tag-ion,ion,tag-ion-attn,ion-attn,fa3,fa3-layer \
    KBENCH_REGISTER=$root/bench/results/2026-12-07-h100/consolidation/tag_backends.py \
      bash "$root/scripts/gpu_session.sh" "$out/kernel" ;;
  serve)
    cd "$root"
    [ -f bench/demo-model/config.json ] || python3 scripts/make_demo_model.py bench/demo-model
    python3 scripts/serve_soak.py --model bench/demo-model --out "$out/serve/soak" --rounds 3 \
      --pressure-requests "${SOAK_PRESSURE_REQUESTS:-300}" --time-budget "${SOAK_S:-400}" \
      --gpu-memory-utilization 0.5 \
      > "$out/soak.log" 2>&1 &
    soak=$! t0=$(date +%s)
    # the sanitizer starts once the server is up: vLLM's start-up memory profile fails when
    # another process frees GPU memory during it
    until grep -qs "Application startup complete" "$out/serve/soak/serve.log" \
        || ! kill -0 "$soak" 2> /dev/null || [ $(( $(date +%s) - t0 )) -ge 300 ]; do sleep 2; done
    left=$(( ${SESSION_DEADLINE_S:-420} - ($(date +%s) - t0) ))
    a=tests/test_kv_append.py t=tests/test_kv_tier_gpu.py
    SESSION_STEPS=sanitize SANITIZE_CASES=108 SANITIZE_SHARD=${SANITIZE_SHARD:-0/7} \
    SANITIZE_BUDGET_S=$(( left - 90 )) SESSION_DEADLINE_S=$left \
    SANITIZE_TESTS="$a::test_kv_append_matches_reference[128-idx_dtype0-dtype0]
      $a::test_kv_append_matches_reference[256-idx_dtype1-dtype1]
      $a::test_kv_append_single_token_and_empty $t::test_store_load_roundtrip
      $t::test_random_ops_cuda[ion-batch]" \
      bash "$root/scripts/gpu_session.sh" "$out/serve/sanitize" || true
    wait "$soak" || true
    mv "$out/soak.log" "$out/serve/" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
tar czf "$out/$stage.tgz" -C "$out" "$stage" && rm -rf "${out:?}/$stage"
