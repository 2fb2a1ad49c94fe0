"""``python -m runtime.bench.spec``: n-gram speculative decoding on vs off on the real model.

Starts one engine with ``--spec-tokens 0`` and one with ``--spec-tokens K`` (same flags otherwise),
sends the same concurrent greedy requests to each — half with a repetitive prompt (a counting
cycle, where prompt-lookup drafts get accepted), half with random-token prompts (where they
rarely do) — checks that both runs emit identical tokens, and reports per run: output tokens/s,
engine steps, output tokens per step, and with speculation the acceptance rate (accepted /
proposed drafts) and tokens per decode row with drafts. JSON to ``--out``
(default ``bench-results/spec_decode.json``).

    python -m runtime.bench.spec --pp 2 --spec-tokens 4 --num-requests 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import random
import time
from pathlib import Path

from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams

#: "1, 2, 3, 4, 5, " repeated, in SmolLM2 token ids (the default model's tokenizer)
CYCLE = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216]


def prompts(n: int, seed: int) -> list[list[int]]:
    """Half repetitive (the cycle x 3 plus a start), half 40 random ids in [100, 40000)."""
    rng = random.Random(seed)
    return [CYCLE * 3 + CYCLE[:3 * (i % 5 + 1)] if i % 2 == 0
            else [rng.randrange(100, 40000) for _ in range(40)] for i in range(n)]


async def run_one(config, batch: list[list[int]], max_tokens: int) -> dict:
    """One engine: warm up, run ``batch`` concurrently, report throughput and step figures."""
    engine = await AsyncEngine.start(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(rid: str, ids: list[int], p: SamplingParams) -> list[int]:
        return [t async for out in engine.add_request(rid, ids, p) for t in out.new_token_ids]
    try:
        await one("warmup", batch[0], SamplingParams(max_tokens=4, temperature=0.0))
        s0, t0 = engine.stats(), time.perf_counter()
        tokens = await asyncio.gather(*(one(f"b{i}", p, params) for i, p in enumerate(batch)))
        wall, s1 = time.perf_counter() - t0, engine.stats()
    finally:
        await engine.shutdown()
    d = {k: s1[k] - s0[k] for k in ("steps_total", "generated_tokens_total", "spec_proposed_tokens",
                                     "spec_accepted_tokens", "spec_decode_rows")}
    out = sum(len(t) for t in tokens)
    return {"spec_tokens": config.scheduler.num_spec_tokens, "wall_s": wall, "output_tokens": out,
            "output_tokens_per_s": out / wall, "steps": d["steps_total"],
            "output_tokens_per_step": out / max(d["steps_total"], 1),
            "acceptance_rate": (d["spec_accepted_tokens"] / d["spec_proposed_tokens"]
                                if d["spec_proposed_tokens"] else None),
            "tokens_per_spec_row": (1 + d["spec_accepted_tokens"] / d["spec_decode_rows"]
                                    if d["spec_decode_rows"] else None),
            "token_ids": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.spec", description=__doc__)
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/spec_decode.json")
    add_engine_flags(p)
    args = p.parse_args(argv)
    config = engine_config(p, args)
    k = config.scheduler.num_spec_tokens or 4
    batch = prompts(args.num_requests, args.seed)
    runs = [asyncio.run(run_one(config.model_copy(update={"scheduler": dataclasses.replace(config.scheduler, num_spec_tokens=s)}), batch, args.max_tokens))
            for s in (0, k)]
    same = runs[0]["token_ids"] == runs[1]["token_ids"]
    for r in runs:
        del r["token_ids"]
    report = {"pp_size": config.scheduler.pp_size, "num_requests": args.num_requests,
              "max_tokens": args.max_tokens, "spec_ngram": config.spec_ngram, "off": runs[0],
              "on": runs[1], "identical_tokens": same,
              "speedup": runs[1]["output_tokens_per_s"] / runs[0]["output_tokens_per_s"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
