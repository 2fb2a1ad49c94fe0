#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md in one go (a device call): GPU tests, the engine on a
# random-weight SmolLM2-shaped folder (fast path with graphs / eager / validation off), the
# rank's host time per step (`runtime.bench.gpu_runner`) and `python -m runtime.bench gpu`. Usage: benchmarks/run_gpu.sh OUTDIR [PP]   (PP=2 needs 2 GPUs)
set -u
out=${1:?outdir}; pp=${2:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -q -rs -k "not interpreter" \
    tests/runtime/test_attention_kernels.py tests/gpu/test_gpu_fast_path.py \
    tests/gpu/test_gpu_mirror_check.py tests/runtime/test_post_update.py tests/gpu/test_gpu_engine.py \
    tests/runtime/test_sampling_state.py tests/runtime/test_step_inputs.py > "$out/tests.log" 2>&1
  tail -4 "$out/tests.log"
fi
folder=/tmp/smollm2-random
[ -d $folder ] || python3 -m runtime.bench gpu --shapes smollm2-135m --make-folder $folder > /dev/null 2>&1
eng="python3 -m runtime.bench --model $folder --device cuda --dtype bfloat16 --num-requests 128
     --max-num-seqs 128 --prompt-len 32 --max-tokens 128 --max-model-len 256
     --max-num-batched-tokens 4096 --max-prefill-chunk 4096"
if [ "${SKIP_ENGINE:-0}" != 1 ]; then
  for v in "graphs:" "eager:--enforce-eager" "novalidate:--validate-mirrors off"; do
    name=${v%%:*}; flags=${v#*:}
    timeout 120 $eng --pp 1 --modes sync $flags --out "$out/engine-pp1-$name.json" 2>&1 | grep -v Warn | tail -2
  done
  if [ "$pp" = 2 ]; then
    timeout 150 $eng --pp 2 --out "$out/engine-pp2.json" 2>&1 | grep -v Warn | tail -3
  fi
fi
timeout 90 python3 -m runtime.bench.gpu_runner --rows 256 --out "$out/runner-256.json" 2>&1 | grep rows
timeout ${BENCH_TIMEOUT:-330} python3 -m runtime.bench gpu --pp "$pp" ${BENCH_FLAGS:-} --out "$out/gpu.json" \
  > "$out/bench.log" 2>&1
grep -v "Warn\|warn\|capturing" "$out/bench.log" | tail -40
