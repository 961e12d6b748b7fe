#!/usr/bin/env bash
# Thirteenth session, call 3: v16 (pinned PV wait) correctness, then the kernel A/B.
#   bash bench/results/2026-12-02-h200/session13/pin_ab.sh OUT
# Assumes the bundles are sourced and the project installed on the host.
set -uo pipefail
out=${1:?OUT}
mkdir -p "$out"
t=tests/test_pin_pv_wait_gpu.py
i=0
for k in "reference and bf16" "reference and fp16" "split_kv or experiments" "fused"; do
  CUTE_DSL_CACHE_DIR=/tmp/ion-cute-pin$i timeout 240 python3 -m pytest -m gpu -q \
    -p no:cacheprovider "$t" -k "$k" > "$out/pytest-pin.$i.log" 2>&1 &
  i=$((i + 1))
done
wait
for f in "$out"/pytest-pin.*.log; do echo "$f: $(tail -1 "$f")"; done
b=ion-auto,ion-auto-pin,ion-auto-fused,ion-auto-fused-pin,fa3
SESSION_STEPS=kbench KBENCH_TIMING=interleaved KBENCH_BACKENDS=$b \
  bash scripts/gpu_session.sh "$out/s" > "$out/session.log" 2>&1
echo "gpu_session rc=$?"
timeout 200 python3 -m ion_vllm.bench.cli kernel --case prefill-1x8192-h28/4-d128 \
  --backends "$b" --timing interleaved --no-ceilings --out "$out/pf" > "$out/pf.log" 2>&1
echo "prefill rerun rc=$?"
cat "$out"/s/kbench/table.md 2>/dev/null
tail -12 "$out/pf.log"
