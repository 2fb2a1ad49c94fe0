"""``python -m runtime.bench.tp_checks``: the tensor-parallel checks of tests/runtime/test_tp_pipelines.py
as a script with timings (docs/tp.md),
on a tiny random Qwen2 (2 layers, hidden 64, q/k/v biases) saved by transformers, its greedy ids
from transformers' ``generate`` as the reference:

* ``dp``: TP=2 x PP=2 x DP=2 (8 rank processes, two replicas): greedy ids equal the reference;
* ``sync``: TP=2 x PP=2 with the sync schedule (one batch in flight): the same;
* ``kill``: TP=2 x PP=2 under the restart supervisor (``--restart-workers``); SIGKILL of global
  rank 3 (stage 1, TP rank 1) mid-decode: the in-flight request fails (seconds until it does),
  the supervisor restarts the workers (seconds), later greedy ids equal the reference.

Example::

    python -m runtime.bench.tp_checks --checks dp,sync,kill --json-out benchmarks/results/tp-checks.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

from runtime.bench.results import write_result

PROMPTS = [[100 + 7 * i + j for j in range(6 + 4 * i)] for i in range(4)]
NEW = 6


def tiny_qwen2(folder: Path):
    """Save a random 2-layer Qwen2 (vocab 512) and a word-level tokenizer; returns the model."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=256, rms_norm_eps=1e-6)
    model = tf.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(folder))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "t1"}')
    return model


def reference(model) -> list[list[int]]:
    """transformers' greedy ids of :data:`PROMPTS` (EOS ignored)."""
    import torch
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
                               eos_token_id=None)
            out.append(g[0, len(p):].tolist())
    return out


async def _greedy(engine) -> list[list[int]]:
    from runtime.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

    async def one(i, p):
        ids = []
        async for out in engine.add_request(f"c{i}-{time.monotonic_ns()}", p, params):
            ids += out.new_token_ids
        return ids
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


async def check_dp(config) -> dict:
    """TP=2 x PP=2 x DP=2: start seconds and greedy ids."""
    from runtime.dp.replicas import start_engine
    t0 = time.perf_counter()
    engine = await start_engine(config.replace(pp_size=2, dp_size=2))
    started = time.perf_counter() - t0
    try:
        return {"start_s": round(started, 2), "ids": await _greedy(engine)}
    finally:
        await engine.shutdown()


async def check_sync(config) -> dict:
    """TP=2 x PP=2, sync schedule: greedy ids."""
    from runtime.engine import AsyncEngine
    engine = await AsyncEngine.start(config.replace(pp_size=2, mode="sync"))
    try:
        return {"ids": await _greedy(engine)}
    finally:
        await engine.shutdown()


async def check_kill(config) -> dict:
    """SIGKILL of global rank 3 mid-decode under the restart supervisor: the in-flight error,
    seconds until it failed and until an engine serves again, greedy ids afterwards."""
    from runtime.engine.supervisor import EngineSupervisor
    from runtime.sampling_params import SamplingParams
    sup = await EngineSupervisor.start(config.replace(pp_size=2), max_restarts=1, backoff_s=0.0)
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        n, killed, last = 0, None, None
        async for out in sup.add_request("victim", PROMPTS[0], params):
            n += len(out.new_token_ids)
            if n >= 3 and killed is None:
                os.kill(sup.engine.pool.procs[3].pid, signal.SIGKILL)   # stage 1, TP rank 1
                killed = time.monotonic()
            last = out
        failed_s = time.monotonic() - killed
        while not sup.is_alive and time.monotonic() - killed < 120:
            await asyncio.sleep(0.1)
        restart_s = time.monotonic() - killed
        return {"in_flight_error": last.error, "failed_after_s": round(failed_s, 2),
                "alive_again_after_s": round(restart_s, 2), "restarts": sup.restarts,
                "ids": await _greedy(sup)}
    finally:
        await sup.shutdown()


def main(argv: list[str] | None = None) -> dict:
    """Run the ``--checks`` in turn; returns their results (each with ``equal_to_transformers``),
    also written to ``--json-out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checks", default="dp,sync,kill")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    from runtime.config import EngineConfig
    folder = Path(tempfile.mkdtemp(prefix="tp-checks-"))
    want = reference(tiny_qwen2(folder))
    config = EngineConfig(model=str(folder), tp_size=2, device=args.device, dtype="float32",
                          max_num_seqs=8, max_model_len=64, max_prefill_chunk=8,
                          max_num_batched_tokens=32, step_timeout_s=30.0)
    results = {}
    for name in args.checks.split(","):
        r = asyncio.run({"dp": check_dp, "sync": check_sync, "kill": check_kill}[name](config))
        r["equal_to_transformers"] = r["ids"] == want
        results[name] = r
        print(name, {k: v for k, v in r.items() if k != "ids"}, flush=True)
    if args.json_out:
        write_result(args.json_out, "tp-checks", results, vars(args), "python -m "
                     "runtime.bench.tp_checks " + shlex.join(sys.argv[1:] if argv is None else argv))
    return results


if __name__ == "__main__":
    main()
