#!/usr/bin/env bash
# `vllm serve MODEL --attention-backend ION` starts and answers /v1/completions.
# Usage (on the GPU host, project installed): scripts/serve_check.sh [MODEL_DIR] [OUT_DIR]
set -uo pipefail
model=${1:-bench/demo-model}
out=${2:-bench/results/serve-check}
port=${ION_SERVE_PORT:-8123}
mkdir -p "$out"
[ -f "$model/config.json" ] || python3 scripts/make_demo_model.py "$model"
log="$out/serve.log"
python3 -m vllm.entrypoints.cli.main serve "$model" --load-format dummy --attention-backend ION \
  --port "$port" --max-model-len 8192 --gpu-memory-utilization 0.85 >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
t0=$(date +%s)
until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
  if ! kill -0 $pid 2>/dev/null; then echo "server exited"; tail -40 "$log"; exit 1; fi
  if [ $(( $(date +%s) - t0 )) -gt 400 ]; then echo "server did not come up"; tail -40 "$log"; exit 1; fi
  sleep 2
done
up=$(( $(date +%s) - t0 ))
resp=$(curl -sf "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$model\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 32, \"temperature\": 0}")
rc=$?
backend_line=$(grep -m1 -i "ION\b.*backend\|backend.*ION\|Using .*ION" "$log" || true)
echo "$resp" > "$out/completion.json"
python3 - "$out/completion.json" "$up" "$rc" "$backend_line" <<'PY'
import json, sys
path, up, rc, line = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    body = json.load(open(path))
    n = body["usage"]["completion_tokens"]
    ok = rc == 0 and n > 0 and body["choices"][0]["text"] is not None
except Exception as e:  # noqa: BLE001
    body, n, ok = {"error": repr(e)}, 0, False
res = {"ok": ok, "startup_s": up, "completion_tokens": n, "backend_log_line": line}
json.dump(res, open(path.replace("completion.json", "serve_check.json"), "w"), indent=1)
print(json.dumps(res))
sys.exit(0 if ok else 1)
PY
