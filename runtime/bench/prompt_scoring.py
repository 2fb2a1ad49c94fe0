"""Prompt scoring (``echo`` + ``logprobs`` with ``max_tokens: 0``, what log-likelihood evaluation
sends) through the real engine: prompts prefilled with and without prompt logprobs, in turn.

    python -m runtime.bench.prompt_scoring --model DIR --device cuda --prompts 64 --prompt-len 256

Each round submits every prompt at once with ``max_tokens`` 1, once asking for prompt logprobs
(``prompt_logprobs=0``: every position's log-softmax on the last rank) and once not, and reports
prompt tokens per second of each and their ratio (the cost of scoring). Prefix caching stays on;
scoring requests skip cache hits, and the unscored run uses distinct prompts per round so neither
side is served from the cache. JSON on stdout (and ``--json-out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def _round(engine, prompts: list[list[int]], scored: bool, tag: str) -> float:
    from runtime.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=0 if scored else None)

    async def one(i: int, p: list[int]) -> int:
        n = 0
        async for out in engine.add_request(f"{tag}-{i}", p, params):
            if out.prompt_logprobs is not None:
                n = sum(e is not None for e in out.prompt_logprobs)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    dt = time.perf_counter() - t0
    if scored:
        assert all(c == len(p) - 1 for c, p in zip(counts, prompts)), "missing prompt logprobs"
    return dt


async def run(args) -> dict:
    import random

    from runtime.config import EngineConfig
    from runtime.engine import AsyncEngine
    cfg = EngineConfig(model=args.model, pp_size=args.pp, device=args.device,
                       max_num_seqs=args.prompts, max_model_len=args.prompt_len + 8,
                       max_prefill_chunk=args.chunk, max_num_batched_tokens=args.chunk)
    engine = await AsyncEngine.start(cfg)
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    out = {"model": args.model, "device": args.device, "pp": args.pp, "prompts": args.prompts,
           "prompt_len": args.prompt_len, "chunk": args.chunk, "rounds": []}
    try:
        for r in range(args.rounds + 1):   # round 0 warms up
            res = {}
            for scored in (True, False):
                prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                           for _ in range(args.prompts)]
                dt = await _round(engine, prompts, scored, f"r{r}-{int(scored)}")
                res["scored_s" if scored else "plain_s"] = round(dt, 4)
            if r:
                tokens = args.prompts * args.prompt_len
                res["scored_tok_s"] = round(tokens / res["scored_s"], 1)
                res["plain_tok_s"] = round(tokens / res["plain_s"], 1)
                res["scored_time_over_plain"] = round(res["scored_s"] / res["plain_s"], 3)
                out["rounds"].append(res)
    finally:
        await engine.shutdown()
    ratios = sorted(r["scored_time_over_plain"] for r in out["rounds"])
    out["median_scored_time_over_plain"] = ratios[len(ratios) // 2]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.prompt_scoring", description=__doc__)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="auto")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    text = json.dumps(res, indent=1)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
