#!/usr/bin/env bash
# Issue #33: speculation off vs K = 2 and 4 at PP=1, batch 1, on one H200, where the n-gram
# proposer finds NOTHING: random token-id prompts on a random-weight SmolLM2-shaped folder,
# sampled at temperature 1 with a seed per request (greedy decoding of random weights falls into
# loops within 128 tokens, which the proposer then serves: measured 2026-12-03, acceptance 0.98;
# near-uniform sampling repeats no 3-gram). The scheduler's probe (--spec-probe-ngram 3) gives
# no row drafts, so every step should run as a plain decode step (target >= 0.95x tokens/s of
# off; seeded tokens identical). The JSON's proposed_tokens must be 0 (checked at the end).
# The engines alternate run by run, the first of a round rotating (--alternate), 12 rounds: runs
# of 1.3 s spread by +-20% on this host, so read speedup_paired_median (the median over rounds of
# the ratio within a round), speedup_adjusted (round and place factored out) and
# speedup_median, not the best runs alone.
# Writes $OUT/spec-nodraft.json and $OUT/spec-nodraft.log. About 2 minutes warm; on a fresh
# machine the first engine compiles its Triton kernels first (BENCH_TIMEOUT covers it).
set -u
out=${1:-${OUT:-device-out}}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
log="$out/spec-nodraft.log"
nvidia-smi --query-gpu=name,utilization.gpu --format=csv | tee "$log"
model=/tmp/smollm2-random
[ -d $model ] || timeout 60 python3 -m runtime.bench.model_folder --shape smollm2-135m \
  --out $model >> "$log" 2>&1
timeout ${BENCH_TIMEOUT:-240} python3 -m runtime.bench.spec --device cuda --dtype bfloat16 --model $model \
  --pp 1 --spec-list 2,4 --workloads unfriendly --num-requests 4 --concurrency 1 --max-tokens 128 \
  --repeats ${ROUNDS:-12} --alternate --temperature ${TEMPERATURE:-1.0} --max-num-seqs 8 --max-model-len 1024 --out "$out/spec-nodraft.json" \
  2>&1 | grep -v -i warn >> "$log"
echo "spec bench rc=${PIPESTATUS[0]}" | tee -a "$log"
python3 - "$out/spec-nodraft.json" <<'PY' | tee -a "$log"
import json, sys
e = json.load(open(sys.argv[1]))["workloads"]["unfriendly"]
for k, r in e.items():
    print(k, {x: r.get(x) for x in ("output_tokens_per_s", "per_token_latency_ms", "steps",
                                    "proposed_tokens", "acceptance_rate", "speedup",
                                    "median_tokens_per_s", "speedup_median",
                                    "speedup_paired_median", "speedup_adjusted",
                                    "identical_tokens")})
print("no proposals:", all(r.get("proposed_tokens") == 0 for r in e.values()))
PY
