#!/usr/bin/env bash
# Run GPU pytest files as N pytest processes side by side (round-robin over the files),
# each with its own CuTeDSL cache dir.  The GPU test list is CPU-compile bound (~6 min in
# one process on the H200 host), and the host has 16 cores, so N shards take about 1/N
# of that.  Tests only check correctness, so sharing the GPU does not matter.
#   scripts/pytest_gpu_shards.sh N LOG_PREFIX FILE...
# Writes LOG_PREFIX.<i>.log per shard, prints every shard's last line, and exits with the
# first nonzero shard status (0 when all shards passed).
set -uo pipefail
n=${1:?usage: pytest_gpu_shards.sh N LOG_PREFIX FILE...}
prefix=${2:?usage: pytest_gpu_shards.sh N LOG_PREFIX FILE...}
shift 2
[ "$n" -ge 1 ] 2>/dev/null || { echo "pytest_gpu_shards: N must be >= 1, got $n" >&2; exit 2; }
[ $# -ge 1 ] || { echo "pytest_gpu_shards: no test files" >&2; exit 2; }
files=("$@")
cache_root=${CUTE_DSL_CACHE_DIR:-/tmp/ion-cute-cache}
pids=()
for ((i = 0; i < n; i++)); do
  shard=()
  for ((j = i; j < ${#files[@]}; j += n)); do shard+=("${files[j]}"); done
  [ ${#shard[@]} -gt 0 ] || continue
  CUTE_DSL_CACHE_DIR="$cache_root-shard$i" python3 -m pytest -m gpu -q -p no:cacheprovider \
    "${shard[@]}" > "$prefix.$i.log" 2>&1 &
  pids+=("$i:$!")
done
rc=0
for entry in "${pids[@]}"; do
  i=${entry%%:*}
  wait "${entry#*:}"
  s=$?
  echo "shard $i rc=$s: $(tail -1 "$prefix.$i.log")"
  [ "$rc" -eq 0 ] && rc=$s
done
exit "$rc"
