#!/usr/bin/env bash
# Kernel-level A/B: ION vs FA3 / FA4 / Triton (vLLM's kernels) on the local GPU.
# Source the GPU environment first (on the H200 host: . /tmp/ion-gpu/env.sh).
# Examples:
#   scripts/bench_kernel.sh                       # smoke suite, all backends
#   scripts/bench_kernel.sh --suite anchors
#   scripts/bench_kernel.sh --case decode-32x8192-h28/4-d128 --backends ion,fa3
# Results: bench/results/<date>-<gpu>/{summary.json,table.md,plot.png} (or --out DIR).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec python3 -m ion_vllm.bench.cli kernel "$@"
