#!/usr/bin/env bash
# The consolidation's GPU evidence in one chain (H200; CuTeDSL + vLLM bundles, ion-vllm
# installed from this checkout):
#   bash bench/results/2026-12-07-h200/consolidation/run.sh OUT TAG_TREE
# TAG_TREE holds the tag's packages: git archive lab-2026-12 cute_kernels ion_vllm | tar x -C TAG_TREE
# Steps (status lines in OUT/steps.txt, logs OUT/<step>.log; a failed step does not stop
# the chain):
#   correct  the kernel GPU tests (8 pytest shards), the 1000-case sweep (4 shards, one
#            seed), kv_append's and the KV tier's GPU tests, side by side
#   kbench   kernel A/B, tag and this checkout in one process, interleaved: suites
#            anchors, engine, engine-d64; the layer (tag-ion, ion), the attention
#            (tag-ion-attn, ion-attn) and FA3
#   startup  vllm serve time-to-ready on the demo model, ION and FLASH_ATTN, CuTeDSL's
#            cache cold and warm
#   e2e      ion-bench e2e --serve --colocate, seed: ION, ION of the tag, FLASH_ATTN
set -uo pipefail
out=${1:?usage: run.sh OUT TAG_TREE}
tag=${2:?usage: run.sh OUT TAG_TREE}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../../.." && pwd)
cd "$root"
mkdir -p "$out"
steps=${STEPS:-correct kbench startup e2e}
seed=${SWEEP_SEED:-$(python3 -c 'import time; print(time.time_ns() % 2**31)')}
demo=${DEMO_MODEL:-/tmp/ion-demo}
export PYTHONSAFEPATH=1  # the servers import the installed packages, not the working dir

stamp() { echo "$(date -u +%H:%M:%S) $*" | tee -a "$out/steps.txt"; }

run_correct() {
  local pids=() i
  # shards of contiguous test ids: a shard's cases share few kernel options, so the
  # shards compile (on the CPU) mostly disjoint sets of kernels
  python3 -m pytest -qq -m gpu --collect-only -p no:cacheprovider tests/test_kernel_gpu.py \
    2>/dev/null | grep '::' | sort > "$out/kernel-tests.txt"
  split -n l/8 -d -a 1 "$out/kernel-tests.txt" "$out/shard"
  for i in 0 1 2 3 4 5 6 7; do
    (python3 -m pytest -q -m gpu -p no:cacheprovider $(cat "$out/shard$i") \
      > "$out/kernel-gpu-$i.log" 2>&1; echo "kernel-gpu shard $i rc=$?" >> "$out/steps.txt") &
    pids+=($!)
  done
  for i in 0 1 2 3; do
    (CUTE_DSL_DISABLE_FILE_CACHING=1 python3 scripts/gpu_sweep.py --cases 1000 --seed "$seed" --shard "$i/4" --quiet \
      --out "$out/sweep-$i" > "$out/sweep-$i.log" 2>&1; echo "sweep shard $i rc=$?" >> "$out/steps.txt") &
    pids+=($!)
  done
  (python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kv_append.py tests/test_kv_tier_gpu.py \
    > "$out/other-gpu.log" 2>&1; echo "kv_append + kv tier GPU tests rc=$?" >> "$out/steps.txt") &
  pids+=($!)
  wait "${pids[@]}"
}

run_kbench() {
  TAG_TREE="$tag" python3 -m ion_vllm.bench.cli kernel --suite anchors --suite engine \
    --suite engine-d64 --backends tag-ion,ion,tag-ion-attn,ion-attn,fa3 \
    --timing interleaved --register "$here/tag_backends.py" --out "$out/kbench" \
    > "$out/kbench.log" 2>&1
}

run_startup() {
  [ -d "$demo" ] || python3 scripts/make_demo_model.py "$demo" > "$out/demo-model.log" 2>&1
  (cd /tmp && python3 -m ion_vllm.bench.cli startup --backends ION,FLASH_ATTN --model "$demo" \
    --load-format dummy --out "$out/startup" --cache-root "$out/startup-caches") \
    > "$out/startup.log" 2>&1
  rm -rf "$out/startup-caches"
}

run_e2e() {
  [ -d "$demo" ] || python3 scripts/make_demo_model.py "$demo" > "$out/demo-model.log" 2>&1
  (cd /tmp && python3 -m ion_vllm.bench.cli e2e --serve --colocate --workload seed \
    --backends "ION,ION@$tag,FLASH_ATTN" --repeats 2 --kv-cache-gib 29 --model "$demo" \
    --out "$out/e2e") > "$out/e2e.log" 2>&1
}

stamp "start seed=$seed steps=[$steps] $(nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader)"
for s in $steps; do
  stamp "$s begin"
  "run_$s"
  stamp "$s end rc=$?"
done
stamp "done"
