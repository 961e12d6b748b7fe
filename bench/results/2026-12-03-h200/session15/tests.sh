#!/usr/bin/env bash
# Fifteenth session, chain call 3 (after the v1, v2 bundle calls): the v18 GPU tests (split
# unpacked tiles, every tile size, plain and fused, every combine kernel, the chunk 2048 over
# 6144 under the default cost model) and the existing unpacked / 192-row tests whose forced
# split plans now split unpacked items too; four pytest shards at once (CPU-compile bound).
#   bash bench/results/2026-12-03-h200/session15/tests.sh OUT
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$out/gpu.csv" 2>&1
run() {  # shard name, pytest args...
  local name=$1; shift
  CUTE_DSL_CACHE_DIR=/tmp/ion-cute-$name timeout 280 python3 -m pytest -m gpu -q \
    -p no:cacheprovider "$@" > "$out/pytest-$name.log" 2>&1
}
t=tests/test_unpacked_split_gpu.py
run s1 "$t" -k "g7 and plain" &
run s2 "$t" -k "g7 and fused" &
run s3 "$t" -k "g3 or combine or chunk_2048" &
run s4 tests/test_unpacked_prefill_gpu.py tests/test_three_consumers_gpu.py -k "split or fused or long_prefill" &
wait
for f in "$out"/pytest-*.log; do echo "$f: $(tail -1 "$f")"; done
grep -h -E "^(FAILED|ERROR)|Error" "$out"/pytest-*.log | head -20
