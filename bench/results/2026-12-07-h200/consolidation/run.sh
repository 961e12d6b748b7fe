#!/usr/bin/env bash
# The consolidation's GPU evidence in one chain (H200; CuTeDSL + vLLM bundles, ion-vllm
# installed from this checkout):
#   setsid nohup bash bench/results/2026-12-07-h200/consolidation/run.sh OUT TAG_TREE > OUT.log 2>&1 &
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# Steps (scripts/gpu_session.sh): the kernel and KV-tier GPU tests and the 1000-case sweep,
# side by side; the kernel A/B of the tag (tag-ion, tag-ion-attn) against this checkout (ion,
# ion-attn) and FA3 in one process, interleaved, on suites anchors, engine and engine-d64;
# vllm serve time-to-ready, ION and FLASH_ATTN, a fresh start and a warm one; e2e seed,
# ION of this checkout and of the tag and FLASH_ATTN, colocated, 2 repeats.
set -euo pipefail
out=${1:?usage: run.sh OUT TAG_TREE}
tag=$(cd "${2:?usage: run.sh OUT TAG_TREE}" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TAG_TREE=$tag \
SESSION_STEPS=${SESSION_STEPS:-"kval kbench startup e2e"} KVAL_KV_TIER=1 STARTUP_COLD=all \
KVAL_TESTS="tests/test_kernel_gpu.py tests/test_kv_append.py tests/test_kv_tier_gpu.py tests/test_gpu_sweep.py tests/test_bench_gpu.py" \
KBENCH_SUITES="anchors engine engine-d64" \
KBENCH_BACKENDS=tag-ion,ion,tag-ion-attn,ion-attn,fa3 \
KBENCH_REGISTER=$here/tag_backends.py \
E2E_WORKLOADS=seed E2E_BACKENDS="ION,ION@$tag,FLASH_ATTN" E2E_BUDGET_S=600 \
  exec bash "$here/../../../../scripts/gpu_session.sh" "$out"
