#!/usr/bin/env bash
# Issue #30 (the HTTP path at scale) on one H200: the engine alone vs the server under the aiohttp
# load client, same workload (128-token random prompts, 128 new tokens, concurrency 256), in one run:
#   1. a random-weight SmolLM2-135M-shaped folder with the real tokenizer (runtime.bench.model_folder)
#   2. engine alone: python -m runtime.bench --pp 1 (256 requests at once)
#   3. server, one process (python -m runtime.serve), 2,000 prompts at concurrency 256 from 4
#      aiohttp client processes, server CPU sampled (--server-pid)
#   4. server split: --api-server-count 4 (engine-core process + 4 API servers), same load
#   5. if time is left: tests/server/test_server_load.py (256 connections, drain, metrics, split)
# Writes to $OUT: engine.json, serve_single.json, serve_split.json, http-summary.json (ratios
# server / engine, failures, CPU shares), server logs, bench.log, tests.log. About 3-4 minutes.
# Usage: benchmarks/device/http.sh [OUTDIR]   (default $OUT, else ./device-out)
set -u
out=${1:-${OUT:-device-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
t_start=$(date +%s)
work=$(mktemp -d /tmp/ppstate-http-XXXXXX)
model="$work/smol"
flags=(--model "$model" --device cuda --pp 1 --max-num-seqs 256 --max-model-len 512
       --max-num-batched-tokens 8192 --max-prefill-chunk 2048)
load=(--dataset random --input-len 128 --output-len 128 --num-prompts 2000 --max-concurrency 256
      --num-clients 4 --no-progress)
server_pid=""

stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -INT "$server_pid"
    for _ in $(seq 1 60); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$server_pid" 2>/dev/null
  fi
  server_pid=""
}
trap stop_server EXIT

wait_ready() {  # $1 = log file; prints the ready line
  for _ in $(seq 1 240); do
    if grep -q "^ready: " "$1"; then grep "^ready: " "$1"; return 0; fi
    kill -0 "$server_pid" 2>/dev/null || { echo "server exited"; tail -20 "$1"; return 1; }
    sleep 0.5
  done
  echo "server not ready in 120 s"; tail -20 "$1"; return 1
}

python3 -c "import torch, aiohttp; print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m runtime.bench.model_folder --shape smollm2-135m --dtype bfloat16 --tokenizer default \
  --out "$model" || exit 1

echo "== engine alone" | tee -a "$out/bench.log"
timeout 150 python3 -m runtime.bench "${flags[@]}" --modes overlapped --num-requests 256 \
  --prompt-len 128 --max-tokens 128 --out "$out/engine.json" >> "$out/bench.log" 2>&1
echo "engine rc=$?"

echo "== server, one process" | tee -a "$out/bench.log"
python3 -m runtime.serve "${flags[@]}" --port 8130 > "$out/server_single.log" 2>&1 &
server_pid=$!
if wait_ready "$out/server_single.log"; then
  timeout 120 python3 -m runtime.bench serve --url http://127.0.0.1:8130 "${load[@]}" \
    --server-pid "$server_pid" --json-out "$out/serve_single.json" >> "$out/bench.log" 2>&1
  echo "serve single rc=$?"
fi
stop_server

echo "== server, --api-server-count 4" | tee -a "$out/bench.log"
python3 -m runtime.serve "${flags[@]}" --port 8131 --api-server-count 4 > "$out/server_split.log" 2>&1 &
server_pid=$!
if line=$(wait_ready "$out/server_split.log"); then
  echo "$line"
  pids=$(echo "$line" | sed -n 's/.*API server processes \[\([0-9, ]*\)\], engine core \([0-9]*\).*/\1,\2/p' | tr -d ' ')
  timeout 120 python3 -m runtime.bench serve --url http://127.0.0.1:8131 "${load[@]}" \
    --server-pid "$pids" --json-out "$out/serve_split.json" >> "$out/bench.log" 2>&1
  echo "serve split rc=$?"
fi
stop_server
tail -40 "$out/bench.log"

python3 - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
eng, single, split = load("engine.json"), load("serve_single.json"), load("serve_split.json")
summary = {"workload": "random 128-token prompts, 128 new tokens, greedy, ignore_eos; engine: 256 "
           "requests at once; server: 2000 prompts at concurrency 256 from 4 aiohttp processes"}
e = eng["results"]["overlapped"]["output_tokens_per_s"] if eng else None
summary["engine_output_tok_s"] = e
for name, doc in (("single", single), ("split", split)):
    if doc is None:
        summary[name] = None
        continue
    r = doc["results"]
    summary[name] = {k: r.get(k) for k in ("output_throughput", "completed", "failed", "errors",
                     "ttft_median_ms", "tpot_median_ms", "itl_median_ms", "client_cpu_fraction",
                     "client_saturated", "server_cpu_fraction")}
    summary[name]["ratio_to_engine"] = r["output_throughput"] / e if e else None
(out / "http-summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
EOF

elapsed=$(( $(date +%s) - t_start ))
if [ "$elapsed" -lt 150 ]; then
  timeout $(( 225 - elapsed )) python3 -m pytest -p no:cacheprovider -q -x --durations=0 \
    tests/server/test_server_load.py > "$out/tests.log" 2>&1
  echo "pytest rc=$?"
  tail -15 "$out/tests.log"
else
  echo "skipped tests/server/test_server_load.py: ${elapsed} s used" | tee "$out/tests.log"
fi
rm -rf "$work"
