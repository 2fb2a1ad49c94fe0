#!/usr/bin/env bash
# Issue #34 (CPU fast path): no GPU code -- this runs on the device host's 16 CPU cores, a quiet
# machine, to give clean CPU figures next to the loaded 2-core ones: the fast-path tests, the GEMM
# candidates (torch fp32 / ONNX Runtime MatMulNBits, 1 thread) and the fast stage's decode step
# time by rows and threads against the exact stage. Needs onnxruntime, onnx, psutil (pyproject)
# and the model wheel (requirements-model.txt). About 3 min.
# Usage: benchmarks/device/cpufast.sh [OUTDIR]   (default $OUT, else ./device-out)
set -u
out=${1:-${OUT:-device-out}}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import onnxruntime, torch, os; print('ort', onnxruntime.__version__, 'torch', torch.__version__, 'cpus', os.cpu_count())"
timeout 150 python3 -m pytest -p no:cacheprovider -q -x tests/runtime/test_cpu_fast_path.py \
  --durations=0 > "$out/cpufast-tests.log" 2>&1
echo "pytest rc=$?"; tail -12 "$out/cpufast-tests.log"
timeout 60 python3 -m runtime.bench cpu-kernels --rows 1,8,64 --rounds 2 --min-s 0.05 \
  --json-out "$out/cpu-kernels-h200host.json" > "$out/cpu-kernels.log" 2>&1
echo "kernels rc=$?"
timeout 90 python3 -m runtime.bench.cpu_step --threads 1,2,4 --rows 1,8,64 \
  --json-out "$out/cpu-step-h200host.json" > "$out/cpu-step.log" 2>&1
echo "step rc=$?"; tail -12 "$out/cpu-step.log"
