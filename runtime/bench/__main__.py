"""``python -m runtime.bench``: overlapped vs sync PP throughput on the real model, one run.

Starts one engine per schedule mode (same flags otherwise), sends ``--num-requests`` concurrent
greedy requests with random-token prompts of ``--prompt-len`` tokens and ``--max-tokens`` new
tokens (EOS ignored; ``--shared-prefix N`` puts one common N-token prefix in front of every
prompt), and reports output tokens/s, mean TTFT / TPOT, the engine's bubble fraction, the
prefix-cache hit rate and preemptions of the run, and the overlapped/sync ratio (ceiling = pp_size, docs/design.md §7). Results are printed and
written as JSON to ``--out`` (default ``bench-results/pp_overlap.json``).

``--trace-cost DIR`` measures the cost of recording: each mode runs ``--repeat`` times without and
with ``--trace-dir DIR`` (alternating, same prompts) and the report adds the traced throughput and
``trace_overhead`` = 1 - median traced / median untraced output tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import time
from pathlib import Path

from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.bench.pp import stream_timed
from runtime.sampling_params import SamplingParams


_one = stream_timed   # one streamed request: TTFT, TPOT, tokens


async def run_mode(config, prompts: list[list[int]], max_tokens: int) -> dict:
    """Start an engine, warm it up with one request, run all prompts concurrently."""
    engine = await AsyncEngine.start(config)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        await _one(engine, "warmup", prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
        s0 = engine.stats()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_one(engine, f"b{i}", p, params) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        s1 = engine.stats()
    finally:
        await engine.shutdown()
    tokens = sum(r["tokens"] for r in res)
    busy = [b - a for a, b in zip(s0["rank_busy_seconds"], s1["rank_busy_seconds"])]
    queried = s1["prefix_cache_query_tokens"] - s0["prefix_cache_query_tokens"]
    hits = s1["prefix_cache_hit_tokens"] - s0["prefix_cache_hit_tokens"]
    return {"mode": config.scheduler.mode, "pp_size": config.scheduler.pp_size, "wall_s": wall,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "steps": s1["steps_total"] - s0["steps_total"],
            "mean_ttft_s": statistics.mean(r["ttft_s"] for r in res),
            "mean_tpot_s": statistics.mean(r["tpot_s"] for r in res),
            "rank_busy_s": busy, "rank_busy_fraction": [b / wall for b in busy],
            "prefix_cache_hit_rate": hits / queried if queried else 0.0,
            "num_preemptions": s1["num_preemptions"] - s0["num_preemptions"],
            "kv_blocks_total": s1["kv_blocks_total"],
            # CPU seconds of the engine process itself (scheduler, detokenizer, zmq, clients):
            # on a 2-core machine it competes with the two ranks in overlapped mode.
            "engine_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}


def _median_run(runs: list[dict]) -> dict:
    """The run with the median output tokens/s, plus every run's figure."""
    ordered = sorted(runs, key=lambda r: r["output_tokens_per_s"])
    return {**ordered[len(ordered) // 2],
            "all_output_tokens_per_s": [r["output_tokens_per_s"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench", description=__doc__)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="overlapped,sync", help="comma list of schedule modes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of one common prefix in front of every prompt (prefix caching)")
    p.add_argument("--out", default="bench-results/pp_overlap.json")
    p.add_argument("--trace-cost", default=None, metavar="DIR", help="also run each mode with "
                   "--trace-dir DIR and report the throughput cost of tracing")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode (and per tracing "
                   "setting with --trace-cost); medians are reported")
    add_engine_flags(p)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    shared = [rng.randrange(100, 40000) for _ in range(args.shared_prefix)]
    prompts = [shared + [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
               for _ in range(args.num_requests)]
    results = {}
    for mode in args.modes.split(","):
        args.pp_schedule = mode
        cfg = engine_config(p, args)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(max(1, args.repeat)):
            for key in ("off", "on") if args.trace_cost else ("off",):
                c = cfg.model_copy(update={"trace_dir": args.trace_cost if key == "on" else None})
                runs[key].append(asyncio.run(run_mode(c, prompts, args.max_tokens)))
                print(json.dumps({"trace": key, **runs[key][-1]}), flush=True)
        results[mode] = _median_run(runs["off"])
        if args.trace_cost:
            traced = _median_run(runs["on"])
            results[mode + "+trace"] = traced
            results[mode]["trace_overhead"] = \
                1.0 - traced["output_tokens_per_s"] / results[mode]["output_tokens_per_s"]
            print(f"{mode}: tracing costs {100 * results[mode]['trace_overhead']:.1f}% "
                  f"throughput ({traced['output_tokens_per_s']:.1f} vs "
                  f"{results[mode]['output_tokens_per_s']:.1f} tok/s)", flush=True)
    if "overlapped" in results and "sync" in results:
        ratio = results["overlapped"]["output_tokens_per_s"] / results["sync"]["output_tokens_per_s"]
        results["overlapped_over_sync"] = ratio
        results["pp_efficiency"] = ratio / args.pp
        print(f"overlapped/sync throughput ratio: {ratio:.2f} (ceiling {args.pp})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


#: ``python -m runtime.bench SUBCOMMAND ...`` -> module whose ``main(argv)`` runs it
SUBCOMMANDS = {"gpu": "runtime.bench.gpu", "serve": "runtime.bench.serve",
               "pp": "runtime.bench.pp", "sched": "runtime.bench.sched",
               "contention": "runtime.bench.contention", "mirror": "runtime.bench.mirror",
               "keepalive": "runtime.bench.keepalive", "cpu-serve": "runtime.bench.cpu_serve",
               "cpu-kernels": "runtime.bench.cpu_kernels"}


if __name__ == "__main__":
    import importlib
    import sys

    from ppstate.cli_pipe import run_main
    if sys.argv[1:2] and sys.argv[1] in SUBCOMMANDS:
        sub = importlib.import_module(SUBCOMMANDS[sys.argv[1]])
        raise SystemExit(run_main(lambda: sub.main(sys.argv[2:])))
    raise SystemExit(run_main(main))
