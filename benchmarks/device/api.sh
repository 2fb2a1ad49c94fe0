#!/usr/bin/env bash
# Issue #32 (OpenAI surface) on one CUDA device: the GPU test of prompt logprobs (fast path, PP=1
# and PP=2 over one GPU, fp32 and bf16, chunked prefill) and logit_bias on the device tables, the
# CPU-side unit tests of the same code, and a prompt-scoring benchmark (prompt logprobs on vs off,
# SmolLM2-shaped random bf16 weights). About 2-3 min.
# Usage: benchmarks/device/api.sh [OUTDIR]   (default $OUT, else ./device-out)
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())"
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs \
  tests/gpu/test_gpu_prompt_logprobs.py tests/runtime/test_prompt_logprobs.py \
  tests/core/test_scheduler_fork.py > "$out/api-tests.log" 2>&1
echo "pytest rc=$?"
tail -6 "$out/api-tests.log"
folder=$(mktemp -d)
timeout 60 python3 -c "
import sys, torch
from runtime.bench.gpu_models import make_folder
make_folder('smollm2-135m', sys.argv[1], torch.device('cuda', 0))
" "$folder" > "$out/api-folder.log" 2>&1
echo "folder rc=$?"
timeout 120 python3 -m runtime.bench.prompt_scoring --model "$folder" --device cuda --prompts 64 \
  --prompt-len 512 --chunk 4096 --rounds 3 --json-out "$out/api-prompt-scoring.json" \
  > "$out/api-bench.log" 2>&1
echo "bench rc=$?"
tail -20 "$out/api-bench.log"
