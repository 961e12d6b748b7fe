#!/usr/bin/env bash
# The consolidation's GPU evidence in one chain (one Hopper GPU; CuTeDSL + vLLM bundles,
# ion-vllm installed from this checkout):
#   setsid nohup bash bench/results/2026-12-07-h100/consolidation/run.sh OUT TAG_TREE > OUT.log 2>&1 &
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# Steps (scripts/gpu_session.sh): the kernel and KV-tier GPU tests and the 1000-case sweep,
# side by side; the kernel A/B of the tag (tag-ion, tag-ion-attn) against this checkout (ion,
# ion-attn) and FA3 in one process, interleaved, on suites anchors, engine and engine-d64;
# vllm serve time-to-ready, ION and FLASH_ATTN, a fresh start and a warm one; e2e seed,
# ION of this checkout and of the tag and FLASH_ATTN, colocated (E2E_REPEATS, default 2).
set -euo pipefail
out=${1:?usage: run.sh OUT TAG_TREE}
tag=$(cd "${2:?usage: run.sh OUT TAG_TREE}" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# three colocated servers: 29 GiB of KV each on a 141 GB H200, 9 GiB on an 80 GB H100
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
kv_gib=9; [ "${mib:-0}" -gt 100000 ] && kv_gib=29
TAG_TREE=$tag \
SESSION_STEPS=${SESSION_STEPS:-"kval kbench startup e2e"} KVAL_KV_TIER=1 STARTUP_COLD=all \
KVAL_TESTS="tests/test_kernel_gpu.py tests/test_kv_append.py tests/test_kv_tier_gpu.py tests/test_gpu_sweep.py tests/test_bench_gpu.py" \
KBENCH_SUITES="anchors engine engine-d64" \
KBENCH_BACKENDS=tag-ion,ion,tag-ion-attn,ion-attn,fa3 \
KBENCH_REGISTER=$here/tag_backends.py \
E2E_WORKLOADS=seed E2E_BACKENDS="ION,ION@$tag,FLASH_ATTN" E2E_BUDGET_S=600 \
E2E_KV_GIB=${E2E_KV_GIB:-$kv_gib} \
  exec bash "$here/../../../../scripts/gpu_session.sh" "$out"
