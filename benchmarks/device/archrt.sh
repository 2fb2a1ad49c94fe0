#!/usr/bin/env bash
# Issue #28 (runtime rooms): the GPU tests of the moved code on one CUDA device -- the model's
# kernels (runtime/model/kernels: paged attention, fused norm / RoPE / SiLU, compiled), the worker's
# post-update (runtime/worker/kernels), sampling on CUDA (runtime/sampling), the paged stage with CUDA
# graphs and the engine's fast path (tests/gpu). Behaviour is unchanged by the moves: every test
# should pass as before (expect "1 skipped": the PP=2 NCCL test needs two devices). About 2-3 min.
# Usage: benchmarks/device/archrt.sh [OUTDIR]   (default $OUT, else ./device-out)
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())"
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs -k "not interpreter" \
  tests/gpu tests/runtime/test_attention_kernels.py tests/runtime/test_post_update.py \
  tests/runtime/test_sampler.py tests/runtime/test_sampling_state.py tests/runtime/test_step_inputs.py \
  tests/core/test_imports.py > "$out/archrt-tests.log" 2>&1
echo "pytest rc=$?"
tail -6 "$out/archrt-tests.log"
