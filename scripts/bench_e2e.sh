#!/usr/bin/env bash
# End-to-end A/B through vLLM's own `bench throughput`: --attention-backend ION vs
# FLASH_ATTN, same model and flags, interleaved repeats.
# Source the GPU environment first (on the H200 host: . /tmp/ion-gpu/env.sh) and
# install the package (pip install --no-deps --no-build-isolation --no-index .) so
# vLLM sees the ION plugin.
# Examples:
#   scripts/bench_e2e.sh --workload seed          # ~5-8 min: 2 repeats x 2 backends
#   scripts/bench_e2e.sh --workload long --repeats 1 --accumulate
#   scripts/bench_e2e.sh --workload seed --serve  # TTFT/TPOT via vllm serve + bench serve
#   scripts/bench_e2e.sh --workload all --dry-run # print the vLLM commands only
# Results: bench/results/<date>-<gpu>/{summary.json,table.md,plot.png,logs/,raw/}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 -m ion_vllm.bench.cli e2e "$@"
