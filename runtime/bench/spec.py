"""``python -m runtime.bench.spec``: n-gram speculative decoding on vs off on the real engine.

One engine per ``K`` in ``0`` (off) and ``--spec-list`` (same flags otherwise; ``--device cuda``
runs the Triton fast path with its decode and verify CUDA graphs) serves the same greedy requests
of each workload in turn (one engine after another; ``--alternate``: all engines started at
once and served run by run in turn, the first of each round rotating, so drift of the machine
and the place in a round are not confounded with ``K``):

* ``friendly`` -- prompts that contain their answers: with a text tokenizer (the real SmolLM2
  GGUF) a code snippet to repeat with one name changed and a passage to quote; with a word-level
  tokenizer (random-weight folders) a counting cycle the model is asked to continue;
* ``unfriendly`` -- random token ids, where prompt lookup rarely finds anything.

Each workload runs ``--num-requests`` requests, ``--concurrency`` at a time (default all;
1: batch 1, one after another). Per run it reports
output tokens/s, per-token latency (request wall / its tokens, mean), engine steps, tokens per
step, the acceptance rate (accepted / proposed) and tokens per decode row with drafts, and per
``K`` the speedup over off and whether the tokens are identical to off. JSON to ``--out``.

    python -m runtime.bench.spec --device cuda --spec-list 2,4 --num-requests 4 --concurrency 1
    python -m runtime.bench.spec --pp 2 --spec-tokens 4          # CPU reference path
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

from runtime.bench.spec_args import positive_int, spec_list, temperature, workloads
from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams

#: "1, 2, 3, 4, 5, " repeated, in SmolLM2 token ids (the default model's tokenizer)
CYCLE = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216]

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
PASSAGE = ("The committee met on Tuesday to review the budget. After a long discussion, the "
           "members agreed that the library would receive new funding for its children's "
           "reading programme, and that the bridge repairs would be postponed until spring.")
TEXT_FRIENDLY = [
    f"Passage: {PASSAGE}\n\nQuote the passage word for word.\nQuote: ",
    f"{CODE}\n# The same code with total_price renamed to compute_total:\ndef compute_total(",
    f"Passage: {PASSAGE}\n\nWhat did the members agree? Answer with the exact sentence.\n"
    "Answer: After a long discussion,",
    f"{CODE}\n# The same code again, unchanged:\n",
]


def word_level(tokenizer) -> bool:
    """Whether ``tokenizer`` is the word-level one of the random-weight folders (``t0`` ..)."""
    return tokenizer is None or tokenizer.id_to_token(5) == "t5"


def prompts(workload: str, n: int, seed: int, tokenizer=None, vocab: int = 40000) -> list[list[int]]:
    """``n`` prompts (token ids) of ``workload`` (``friendly`` / ``unfriendly`` / ``mixed``:
    alternating)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = workload if workload != "mixed" else ("friendly" if i % 2 == 0 else "unfriendly")
        if kind == "unfriendly":
            out.append([rng.randrange(100, vocab) for _ in range(40)])
        elif word_level(tokenizer):
            out.append(CYCLE * 3 + CYCLE[:3 * (i % 5 + 1)])
        else:
            out.append(tokenizer.encode(TEXT_FRIENDLY[i % len(TEXT_FRIENDLY)]))
    return out


async def _serve(engine, batch: list[list[int]], max_tokens: int,
                 concurrency: int | None = None, temperature: float = 0.0) -> dict:
    """Serve ``batch``; greedy, or with ``temperature`` > 0 seeded sampling (request ``i`` seed
    ``i``: the same tokens with and without speculation)."""
    gate = asyncio.Semaphore(concurrency or len(batch))

    async def one(rid: str, ids: list[int], i: int):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                                seed=i if temperature else None)
        async with gate:
            t0, got = time.perf_counter(), []
            async for out in engine.add_request(rid, ids, params):
                got += out.new_token_ids
            return got, time.perf_counter() - t0
    s0, t0 = engine.stats(), time.perf_counter()
    res = await asyncio.gather(*(one(f"b{time.monotonic_ns()}-{i}", p, i)
                                 for i, p in enumerate(batch)))
    wall, s1 = time.perf_counter() - t0, engine.stats()
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("steps_total", "spec_proposed_tokens",
                                                   "spec_accepted_tokens", "spec_decode_rows")}
    tokens = [r[0] for r in res]
    out = sum(len(t) for t in tokens)
    return {"wall_s": wall, "output_tokens": out, "output_tokens_per_s": out / wall,
            "per_token_latency_ms": 1e3 * sum(w / max(len(t), 1) for t, w in res) / len(res),
            "steps": d["steps_total"], "output_tokens_per_step": out / max(d["steps_total"], 1),
            "acceptance_rate": (d["spec_accepted_tokens"] / d["spec_proposed_tokens"]
                                if d["spec_proposed_tokens"] else None),
            "tokens_per_spec_row": (1 + d["spec_accepted_tokens"] / d["spec_decode_rows"]
                                    if d["spec_decode_rows"] else None),
            "proposed_tokens": d["spec_proposed_tokens"], "token_ids": tokens}


async def run_one(config, batches: dict[str, list[list[int]]], max_tokens: int,
                  repeats: int = 1, concurrency: int | None = None,
                  temperature: float = 0.0) -> dict:
    """One engine: warm up, then each workload's batch ``repeats`` times (the best run kept)."""
    engine = await AsyncEngine.start(config)
    try:
        first = next(iter(batches.values()))[0]
        await _serve(engine, [first], 8)
        res = {}
        for name, batch in batches.items():
            runs = [await _serve(engine, batch, max_tokens, concurrency, temperature)
                    for _ in range(repeats)]
            res[name] = max(runs, key=lambda r: r["output_tokens_per_s"])
    finally:
        await engine.shutdown()
    return res


async def run_alternated(configs: dict, batches: dict[str, list[list[int]]], max_tokens: int,
                         repeats: int = 1, concurrency: int | None = None,
                         temperature: float = 0.0) -> dict:
    """All engines (``configs``: ``K -> EngineConfig``) started at once and warmed up, then each
    round serves every workload on each engine in turn, ``repeats`` rounds, the engine that
    goes first rotating from round to round (off, K1, K2; K1, K2, off; K2, off, K1; ...): drift
    of the machine over the run, and any cost of a place in the round, are shared by every
    ``K`` instead of being confounded with it. Returns ``K -> workload -> run``: the best run,
    with ``runs_tokens_per_s`` (every run's tokens/s, round by round), ``runs_position`` (its
    place in its round, 0 = first) and ``median_tokens_per_s`` added."""
    engines = {}
    try:
        for k, cfg in configs.items():
            engines[k] = await AsyncEngine.start(cfg)
            await _serve(engines[k], [next(iter(batches.values()))[0]], 8)
        res: dict = {k: {} for k in configs}
        runs: dict = {(k, name): [] for k in configs for name in batches}
        order = list(engines)
        for rnd in range(repeats):
            turn = order[rnd % len(order):] + order[:rnd % len(order)]
            for name, batch in batches.items():
                for pos, k in enumerate(turn):
                    r = await _serve(engines[k], batch, max_tokens, concurrency, temperature)
                    runs[k, name].append((r["output_tokens_per_s"], pos))
                    best = res[k].get(name)
                    if best is None or r["output_tokens_per_s"] > best["output_tokens_per_s"]:
                        res[k][name] = r
    finally:
        for engine in engines.values():
            await engine.shutdown()
    for (k, name), got in runs.items():
        rates = [g[0] for g in got]
        res[k][name] = dict(res[k][name], runs_tokens_per_s=rates,
                            runs_position=[g[1] for g in got],
                            median_tokens_per_s=statistics.median(rates))
    return res


def adjusted_speedups(runs: dict) -> dict:
    """Each engine's tokens/s relative to the first one's with the round and the place in the
    round factored out: the least-squares fit of ``log(rate) = round + engine + place`` over
    every run of an alternated benchmark (rounds, engines and places crossed by the rotation).

    Args:
        runs: ``K -> (rates, places)``, ``[R]`` tokens/s and ``[R]`` place in the round of each
            engine's runs, round by round (``runs_tokens_per_s``, ``runs_position``); the first
            key is the reference (off).
    Returns:
        ``K -> exp(engine effect)`` for every key but the first.
    """
    import numpy as np
    keys = list(runs)
    n_rounds = len(runs[keys[0]][0])
    n_places = 1 + max(max(p) for _, p in runs.values())
    x, y = [], []
    for e, k in enumerate(keys):
        for r, (rate, place) in enumerate(zip(*runs[k])):
            row = np.zeros(n_rounds + len(keys) - 1 + n_places - 1)
            row[r] = 1.0
            if e:
                row[n_rounds + e - 1] = 1.0
            if place:
                row[n_rounds + len(keys) - 1 + place - 1] = 1.0
            x.append(row)
            y.append(np.log(rate))
    coef = np.linalg.lstsq(np.array(x), np.array(y), rcond=None)[0]
    return {k: float(np.exp(coef[n_rounds + e - 1])) for e, k in enumerate(keys) if e}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=positive_int, default=8, help="requests per workload")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="requests in flight at once (default: all; 1: batch 1, one after another)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", type=workloads, default=["mixed"],
                   help="comma-separated: friendly, unfriendly, mixed (default: mixed)")
    p.add_argument("--spec-list", type=spec_list, default=None,
                   help="comma-separated K values to compare with off (default: --spec-tokens or 4)")
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per workload (best kept)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="0: greedy (default); > 0: seeded sampling (request i seed i). On random "
                        "weights, 1.0 draws near-uniform tokens: a workload with no proposals")
    p.add_argument("--alternate", action="store_true",
                   help="start every engine at once and alternate them run by run, the first "
                        "one rotating per round (off, K1, K2; K1, K2, off; ...), instead of one "
                        "engine after another; adds every run's tokens/s, the median, "
                        "speedup_median, speedup_paired_median (median over rounds of the "
                        "ratio within a round) and speedup_adjusted (round and place in the "
                        "round factored out, adjusted_speedups) to the JSON")
    p.add_argument("--out", default="bench-results/spec_decode.json")
    add_engine_flags(p)
    args = p.parse_args(argv)
    config = engine_config(p, args)
    ks = args.spec_list or [config.scheduler.num_spec_tokens or 4]
    tokenizer = None
    try:
        from runtime.model.registry import resolve_model_path
        from runtime.model.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(resolve_model_path(config.model))
    except Exception as exc:   # a folder without a tokenizer: token-id prompts only
        print(f"no tokenizer ({exc}); token-id prompts")
    vocab = tokenizer.vocab_size if tokenizer is not None else 40000
    batches = {w: prompts(w, args.num_requests, args.seed, tokenizer, min(vocab, 40000))
               for w in args.workloads}
    configs = {k: config.model_copy(update={"scheduler": dataclasses.replace(
        config.scheduler, num_spec_tokens=k)}) for k in [0] + ks}
    if args.alternate:
        runs = asyncio.run(run_alternated(configs, batches, args.max_tokens, args.repeats,
                                          args.concurrency, args.temperature))
    else:
        runs = {k: asyncio.run(run_one(cfg, batches, args.max_tokens, args.repeats,
                                       args.concurrency, args.temperature))
                for k, cfg in configs.items()}
    report = {"device": config.device, "pp_size": config.scheduler.pp_size,
              "model": str(config.model), "num_requests": args.num_requests,
              "concurrency": args.concurrency or args.num_requests,
              "max_tokens": args.max_tokens, "spec_ngram": config.spec_ngram,
              "temperature": args.temperature, "alternated": args.alternate,
              "text_prompts": not word_level(tokenizer), "workloads": {}}
    ok = True
    for w in batches:
        off = runs[0][w]
        entry = {"off": off}
        for k in ks:
            on = runs[k][w]
            same = on["token_ids"] == off["token_ids"]
            ok &= same
            entry[f"k{k}"] = dict(on, identical_tokens=same,
                                  speedup=on["output_tokens_per_s"] / off["output_tokens_per_s"])
            if "median_tokens_per_s" in on:   # --alternate: the ratio of the medians, and
                # the median over rounds of the ratio within a round (paired: drift cancels)
                entry[f"k{k}"]["speedup_median"] = (on["median_tokens_per_s"]
                                                    / off["median_tokens_per_s"])
                entry[f"k{k}"]["speedup_paired_median"] = statistics.median(
                    a / b for a, b in zip(on["runs_tokens_per_s"], off["runs_tokens_per_s"]))
        if args.alternate and args.repeats > 1:   # round and place in the round factored out
            adj = adjusted_speedups({k: (runs[k][w]["runs_tokens_per_s"],
                                         runs[k][w]["runs_position"]) for k in [0] + ks})
            for k in ks:
                entry[f"k{k}"]["speedup_adjusted"] = adj[k]
        for r in entry.values():
            r.pop("token_ids", None)
        report["workloads"][w] = entry
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
