#!/usr/bin/env bash
# The two-GPU part of docs/gpu.md (a device call on a 2-GPU machine): the PP=2 NCCL tests, the
# engine at PP=2 (overlapped vs sync) and `python -m runtime.bench gpu --pp 2 --pp2-only`.
# Usage: benchmarks/run_gpu_pp2.sh OUTDIR
set -u
out=${1:?outdir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs \
  "tests/gpu/test_gpu_fast_path.py::test_pp2_nccl_sync_equals_pp1_and_overlapped_close_and_broadcast_order" \
  "tests/gpu/test_gpu_engine.py::test_engine_greedy_equals_transformers[2-False]" > "$out/tests.log" 2>&1
tail -4 "$out/tests.log"
folder=/tmp/smollm2-random
[ -d $folder ] || python3 -m runtime.bench gpu --shapes smollm2-135m --make-folder $folder > /dev/null 2>&1
timeout 150 python3 -m runtime.bench --model $folder --device cuda --dtype bfloat16 --pp 2 \
  --num-requests 256 --max-num-seqs 256 --prompt-len 32 --max-tokens 128 --max-model-len 256 \
  --max-num-batched-tokens 8192 --max-prefill-chunk 4096 --out "$out/engine-pp2.json" 2>&1 \
  | grep -v Warn | tail -3
timeout ${BENCH_TIMEOUT:-300} python3 -m runtime.bench gpu --pp 2 --pp2-only --out "$out/gpu-pp2.json" \
  > "$out/bench.log" 2>&1
grep -v "Warn\|warn\|capturing" "$out/bench.log" | tail -16
