#!/usr/bin/env bash
# The reliability issue's GPU evidence, in three device calls (each under 10 minutes; one
# Hopper GPU, CuTeDSL + vLLM bundles, ion-vllm installed from this checkout).  Each stage
# leaves one archive, OUT/<stage>.tgz (a device call brings back only a few files):
#   bash bench/results/2026-12-07-h100/reliability/run.sh kernel   OUT TAG_TREE
#   bash bench/results/2026-12-07-h100/reliability/run.sh soak     OUT
#   bash bench/results/2026-12-07-h100/reliability/run.sh sanitize OUT
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# kernel:   the int32-offset and 10-run repeat kernel tests, the kv_append and KV-tier GPU
#           tests, beside a 4000-case sweep (2000 per default path: fused writeback and
#           kv_append), then the anchor suite of this checkout against the tag,
#           interleaved in one process.
# soak:     scripts/serve_soak.py on the demo model, 3 rounds of 2000 mixed requests then
#           300 under memory pressure, 256 concurrent clients, 5% hang up mid-stream.
# sanitize: compute-sanitizer memcheck, racecheck and synccheck, side by side, over a
#           reduced sweep (48 cases: every G, head size, path and tile size) and the
#           kv_append and KV-tier GPU tests (gpu_session.sh, step sanitize).
set -euo pipefail
stage=${1:?usage: run.sh kernel|soak|sanitize OUT [TAG_TREE]}
out=${2:?usage: run.sh kernel|soak|sanitize OUT [TAG_TREE]}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../../.." && pwd)
mkdir -p "$out"
case $stage in
  soak)
    cd "$root"
    [ -f bench/demo-model/config.json ] || python3 scripts/make_demo_model.py bench/demo-model
    python3 scripts/serve_soak.py --model bench/demo-model --out "$out/soak" --rounds 3 \
      --pressure-requests "${SOAK_PRESSURE_REQUESTS:-300}" --time-budget "${SOAK_S:-560}" \
      || true ;;
  kernel)
    tag=$(cd "${3:?kernel needs TAG_TREE}" && pwd)
    TAG_TREE=$tag SESSION_STEPS="kval kbench" KVAL_KV_TIER=1 KVAL_CASES=4000 \
    KVAL_SWEEP_SHARDS=8 SESSION_DEADLINE_S=${SESSION_DEADLINE_S:-570} \
    KVAL_TESTS="tests/test_kernel_gpu.py::test_cache_past_int32_offsets tests/test_kernel_gpu.py::test_split_kv_repeats_bit_identically tests/test_kv_append.py tests/test_kv_tier_gpu.py" \
    KBENCH_SUITES=anchors KBENCH_BACKENDS=tag-ion,ion,tag-ion-attn,ion-attn,fa3 \
    KBENCH_REGISTER=$here/../consolidation/tag_backends.py \
      bash "$root/scripts/gpu_session.sh" "$out/kernel" ;;
  sanitize)
    SESSION_STEPS=sanitize SANITIZE_CASES=${SANITIZE_CASES:-48} \
    SESSION_DEADLINE_S=${SESSION_DEADLINE_S:-570} \
      bash "$root/scripts/gpu_session.sh" "$out/sanitize" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
tar czf "$out/$stage.tgz" -C "$out" "$stage" && rm -rf "${out:?}/$stage"
