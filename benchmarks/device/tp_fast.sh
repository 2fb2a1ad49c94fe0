#!/usr/bin/env bash
# Issue #35, the CUDA fast path under tensor parallelism on one CUDA device: the TP ranks share
# the GPU (gloo with host staging), run the Triton fast path and replay piecewise decode CUDA
# graphs (one graph per segment between the gloo collectives; runtime/worker/tp_graphs.py).
#  1. GPU tests: tests/gpu/test_gpu_tp.py (TP=2xPP=1 / 2xPP=2 fast path fp32 vs transformers with
#     the graph count checked, TP=2 reference path, SmolLM2 shape TP=3 bf16) and
#     tests/gpu/test_gpu_fast_path.py (the PP fast path, whose PagedStage gained the TP hooks);
#  2. python -m runtime.bench.tp on the SmolLM2-135M shape (random bf16): 1x1 (fast path, graphs),
#     then TP=3xPP=1 and TP=3xPP=2 each as reference path and fast path, alternated
#     (tp-fast-bench.json).
# Usage: benchmarks/device/tp_fast.sh [OUTDIR]   (default $OUT, else ./device-out). At most 5 min.
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import torch, triton, transformers; print('cuda', torch.cuda.is_available(), torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs --durations=0 -x tests/gpu/test_gpu_tp.py \
  > "$out/tp-fast-tests.log" 2>&1
echo "pytest tp rc=$?"; grep -v "leaked\|nanobind\|skipped remainder\|refleaks" "$out/tp-fast-tests.log" | tail -25
timeout 60 python3 -m pytest -p no:cacheprovider -q -rs tests/gpu/test_gpu_fast_path.py \
  > "$out/fast-path-tests.log" 2>&1
echo "pytest fast path rc=$?"; tail -3 "$out/fast-path-tests.log"

folder=$(mktemp -d)
timeout 30 python3 -c "
import sys, torch
from runtime.bench.gpu_models import make_folder
make_folder('smollm2-135m', sys.argv[1], torch.device('cuda', 0))
" "$folder" > "$out/tp-folder.log" 2>&1
echo "folder rc=$?"
timeout 150 python3 -m runtime.bench.tp --model "$folder" --device cuda --dtype bfloat16 \
  --layouts 1x1,3x1:ref,3x1,3x2:ref,3x2 --prompts 16 --prompt-len 64 --new-tokens 32 \
  --vocab-max 49000 --json-out "$out/tp-fast-bench.json" > "$out/tp-fast-bench.log" 2>&1
echo "bench rc=$?"; grep -v "loading\|KV cache\|capturing" "$out/tp-fast-bench.log" | tail -12
ls -la "$out"
