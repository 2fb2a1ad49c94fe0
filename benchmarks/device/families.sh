#!/usr/bin/env bash
# Issue #29 (model families) on one H200: the GPU tests of the families' fast path (grouped-GEMM MoE,
# fused q/k norm + RoPE + KV write, a Qwen3-MoE-shaped stage with CUDA graphs vs eager and
# transformers; the Llama fast-path tests as a regression check), then `python -m runtime.bench gpu`
# on the Qwen3-8B shape and the Qwen3-30B-A3B shape (random bf16 weights) against transformers
# `generate` and the roofline, the Llama-3-8B shape's fast path for the step-time comparison, and the
# rank's step loop (scheduler + StageRunner + fast path) on the MoE shape at batch 128.
# Qwen3-30B-A3B runs with its first 24 of 48 layers (qwen3-30b-a3b@24) so that ours and
# transformers' copies fit in memory together and the run fits in 4 minutes: step times of the full
# model are about 2x (layers dominate; the LM head is ~0.6 GB of the 3.0 GB read at batch 1).
# Usage: benchmarks/device/families.sh [OUTDIR]   (default $OUT, else ./device-out). ~3.5 min.
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import torch, transformers; print('cuda', torch.cuda.is_available(), torch.cuda.device_count(), torch.__version__, transformers.__version__)"
timeout 70 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gpu_families.py \
  tests/gpu/test_gpu_fast_path.py tests/runtime/test_attention_kernels.py -k "not interpreter" \
  > "$out/families-tests.log" 2>&1
echo "pytest rc=$?"; tail -4 "$out/families-tests.log"
common="--batches 1,32,128,256 --eager-batches 0 --static-batches 0 --validate-batch 32 \
  --prompt-len 32 --new-tokens 24 --prefill-prompts 2 --prefill-len 2048 --pp-batches 256 \
  --pp-prompt-len 32 --pp-new-tokens 24"
timeout 110 python3 -m runtime.bench gpu --shapes qwen3-8b,qwen3-30b-a3b@24 $common \
  --out "$out/gpu-families.json" > "$out/bench-qwen.log" 2>&1
echo "bench qwen rc=$?"; tail -25 "$out/bench-qwen.log"
timeout 35 python3 -m runtime.bench gpu --shapes llama-3-8b --no-hf $common \
  --out "$out/gpu-llama.json" > "$out/bench-llama.log" 2>&1
echo "bench llama rc=$?"; tail -12 "$out/bench-llama.log"
timeout 30 python3 -m runtime.bench.gpu_runner --shape qwen3-30b-a3b@24 --rows 128 --prompt-len 32 \
  --new-tokens 24 --validate-every 1 --repeat 1 --out "$out/runner-moe.json" > "$out/runner-moe.log" 2>&1
echo "runner rc=$?"; tail -3 "$out/runner-moe.log"
ls -la "$out"
