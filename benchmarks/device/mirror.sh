#!/usr/bin/env bash
# Issue #27 (mirror validation: its cost) on one H200, about 5 minutes (timeouts sum to 665 s, 550 s with QUICK=1;
# the most important parts first):
# 1. a rank's validation per step at 128 and 256 decode rows, off / on / fused / before (fused: the
#    check's flag from one Triton kernel, --mirror-check-kernel fused; the check as of
#    BEFORE_REV, default 2bc6e7d: runtime/worker/mirror_check.py and token_check.py read from git,
#    or from $BEFORE_DIR where the tree has no .git: extract them there beforehand with
#    `git show 2bc6e7d:runtime/worker/mirror_check.py > DIR/mirror_check.py` and the same for
#    token_check.py) alternated in one run (python -m runtime.bench mirror);
# 2. the CUDA tests: block ids shifted on rank 1 / rank 0 / the middle rank at PP=3, both table
#    copies wrong, a fault in each validated field (also on the last rank, whose check rides on
#    its result copy), all caught within one step naming rank and slot, with both check kernels
#    (graph, fused), the compiled fused kernel's flag against the torch one
#    (tests/gpu/test_gpu_mirror_state_faults.py), the async check's own tests, digests;
# 3. the engine (PP=1, SmolLM2-135M shape, random weights; bf16, CUDA graphs) with
#    --validate-mirrors every vs off: two engines (256 slots) taking turns, order alternating per
#    round, at 128 and 256 concurrent requests, 24 rounds of 256 tokens (python -m runtime.bench
#    pp --overheads --overheads-of mirror_validation --overheads-concurrency 128,256
#    --overheads-pin: this process and each engine's rank on disjoint thirds of the cores):
#    throughput, busy and worker-CPU seconds per step (every thread's run time), on / off per
#    round (median, min, max), worker CPU added per step; then the same for
#    --mirror-check-kernel fused vs graph, both validating
#    (--overheads-of mirror_validation,mirror_check_fused; pp-mirror.json holds both);
# 4. the model-free loop on the host CPU (python -m runtime.bench mirror --device cpu);
# 5. three speculative-decoding CUDA tests (the last rank's token mirror with drafts, PP=1 and 2).
# Writes under $OUT (default ./device-out): mirror-tests.log, mirror-bench.log,
# mirror-micro-{gpu,cpu}.json, pp-mirror.json, mirror-summary.json.
# The micro bench also profiles one block per mode call by call (--profile) and times the check's
# CUDA graph alone on the device, and the host time of one replay() of it and of one-node-kind
# graphs. QUICK=1 skips 4 and 5 (SPEC=1 keeps 5); MICRO_ROUNDS, MICRO_TIMEOUT, ENGINE_ROUNDS,
# ENGINE_TOKENS, ENGINE_TIMEOUT, TESTS_TIMEOUT shorten 1, 2 and 3 (defaults 9, 100 s, 24, 256,
# 300 s, 120 s; the engine part runs two pairs, ENGINE_OF=mirror_validation only the first);
# MICRO_ROWS and ENGINE_CONC (default 128,256) pick the points; BEFORE_DEFERRED=1: the before
# revision's check after the flush as now (--before-deferred; a BEFORE_REV from 43918f7 on);
# NO_PROFILE=1 drops the micro bench's --profile.
# Usage: [BEFORE_DIR=DIR] [BEFORE_REV=REV] benchmarks/device/mirror.sh [OUTDIR]
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
log="$out/mirror-bench.log"
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee "$log"

before=(--before-rev "${BEFORE_REV:-2bc6e7d}")
[ -n "${BEFORE_DIR:-}" ] && before+=(--before-dir "$BEFORE_DIR")
[ -n "${BEFORE_DEFERRED:-}" ] && before+=(--before-deferred)
profile=(--profile)
[ -n "${NO_PROFILE:-}" ] && profile=()
timeout ${MICRO_TIMEOUT:-100} python3 -m runtime.bench mirror --rows ${MICRO_ROWS:-128,256} --device cuda \
  --steps 30 --rounds ${MICRO_ROUNDS:-9} "${profile[@]}" "${before[@]}" \
  --json-out "$out/mirror-micro-gpu.json" >> "$log" 2>&1
echo "micro rc=$?" | tee -a "$log"

timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -p no:cacheprovider -q -rs --durations=15 \
  tests/gpu/test_gpu_mirror_state_faults.py tests/gpu/test_gpu_mirror_check.py \
  tests/core/test_block_digest.py tests/runtime/test_mirror_check_layout.py \
  tests/runtime/test_mirror_check_kernel.py \
  > "$out/mirror-tests.log" 2>&1
echo "pytest rc=$?" | tee -a "$log"
tail -4 "$out/mirror-tests.log"

folder=/tmp/smollm2-random
[ -d $folder ] || timeout 30 python3 -m runtime.bench.model_folder --shape smollm2-135m \
  --out $folder >> "$log" 2>&1
timeout ${ENGINE_TIMEOUT:-300} python3 -m runtime.bench pp --pp 1 --workload none --overheads \
  --overheads-of ${ENGINE_OF:-mirror_validation,mirror_check_fused} \
  --overheads-concurrency ${ENGINE_CONC:-128,256} \
  --repeats ${ENGINE_ROUNDS:-24} --overheads-pin \
  --overheads-warmup 2 --num-requests 128 --max-num-seqs 256 --max-tokens ${ENGINE_TOKENS:-256} \
  --max-model-len 384 --max-num-batched-tokens 8192 --max-prefill-chunk 4096 \
  --model $folder --device cuda --dtype bfloat16 --json-out "$out/pp-mirror.json" \
  2>&1 | grep -v -i -E "warn|loading" >> "$log"
echo "engine rc=${PIPESTATUS[0]}" | tee -a "$log"
[ -n "${QUICK:-}" ] || timeout 25 python3 -m runtime.bench mirror --rows 128,256 --device cpu --steps 30 --rounds 4 \
  "${before[@]}" --json-out "$out/mirror-micro-cpu.json" >> "$log" 2>&1

python3 - "$out" <<'PY' | tee -a "$log"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for name in ("mirror-micro-gpu", "mirror-micro-cpu"):
    f = out / f"{name}.json"
    if f.exists():
        summary[name] = [{k: r[k] for k in ("rows", "us_per_step_off", "us_per_step_on",
                                             "validation_us_per_step", "on_over_off",
                                             "before_validation_us_per_step", "before_over_off",
                                             "check_us_per_step", "before_check_us_per_step",
                                             "before_us_per_step_on", "post_step_us_off",
                                             "pieces_us", "check_graph_gpu_us",
                                             "before_check_graph_gpu_us",
                                             "fused_validation_us_per_step", "fused_over_off",
                                             "fused_over_on", "fused_check_us_per_step",
                                             "fused_check_graph_gpu_us", "replay_host_us",
                                             "fused_replay_host_us")
                          if k in r}
                         for r in json.loads(f.read_text())["results"]["results"]]
f = out / "pp-mirror.json"
if f.exists():
    ov = json.loads(f.read_text())["results"]["overheads"]
    for what, tag in (("mirror_validation", "engine"), ("mirror_check_fused", "engine-fused-vs-graph")):
        for pt in ov.get(what, {}).get("points", []):
            summary[f"{tag}-{pt['concurrency']}"] = {
                k: pt[k] for k in pt if k not in ("runs", "concurrency")}
(out / "mirror-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=1)[:3000])
PY
[ -n "${QUICK:-}" ] && [ -z "${SPEC:-}" ] && exit 0
timeout ${SPEC_TIMEOUT:-90} python3 -m pytest -p no:cacheprovider -q -x tests/gpu/test_gpu_spec_decode.py \
  -k "2-1-False or 3-2-True or planted" >> "$out/mirror-tests.log" 2>&1
echo "spec pytest rc=$?" | tee -a "$log"
tail -2 "$out/mirror-tests.log"
