#!/usr/bin/env bash
# Engine PP=1 on one GPU, two code trees alternated in one device call (docs/gpu.md, "Engine PP=1"):
# per round and tree, `runtime.bench.engine_host` (the engine process alone, both transports) and
# the whole engine on a random-weight SmolLM2-shaped folder at 128 and 256 concurrent requests;
# then transformers' generate (static and default cache) at the same batches, once.
# Usage: benchmarks/run_gpu_engine_ab.sh OUTDIR BASE_TREE [ROUNDS]
#   BASE_TREE: a checkout of the code to compare against (e.g. `git worktree add /tmp/base <commit>`).
set -u
out=${1:?outdir}; base=${2:?base tree}; rounds=${3:-2}
new=$PWD
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$out"
folder=/tmp/smollm2-random
[ -d $folder ] || python3 -m runtime.bench gpu --shapes smollm2-135m --make-folder $folder > /dev/null 2>&1
run_tree() {   # run_tree NAME TREE ROUND
  local name=$1 tree=$2 r=$3
  # a tree whose engine_host has no --transport (older code) runs its own bench once, in-process
  local transports="queue"
  grep -q -- "--transport" "$tree/runtime/bench/engine_host.py" && transports="queue zmq"
  for tr in $transports; do
    local flag=""; [ "$transports" != queue ] && flag="--transport $tr"
    (cd "$tree" && PYTHONPATH="$tree:${SITE:-}" timeout 150 python3 -m runtime.bench.engine_host \
      --model $folder --rows 128 256 --repeat 3 $flag --out "$out/host-$name-$tr-$r.json" 2>&1 \
      | grep -v -i warn | tail -2)
  done
  for c in 128 256; do
    (cd "$tree" && PYTHONPATH="$tree:${SITE:-}" timeout 200 python3 -m runtime.bench --model $folder \
      --device cuda --dtype bfloat16 --pp 1 --prompt-len 32 --max-tokens 128 --max-model-len 256 \
      --max-num-batched-tokens 8192 --max-prefill-chunk 4096 --num-requests $c --max-num-seqs $c \
      --modes overlapped --repeat 3 --out "$out/engine-$name-$c-$r.json" 2>&1 | grep -v -i warn | tail -2)
  done
}
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for t in $order; do
    tree=$base; [ $t = new ] && tree=$new
    echo "== round $r: $t"
    run_tree $t "$tree" $r
  done
done
timeout ${HF_TIMEOUT:-300} python3 -m runtime.bench gpu --shapes smollm2-135m --batches 128,256 \
  --static-batches 128,256 --eager-batches "" --out "$out/hf.json" > "$out/hf.log" 2>&1
grep -v -i "warn\|capturing" "$out/hf.log" | tail -8
