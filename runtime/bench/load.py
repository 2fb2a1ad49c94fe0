"""``python -m runtime.bench.load``: many requests at high concurrency against a real engine
(issue #12, item 3).

``--num-requests`` greedy requests (EOS ignored, ``--max-tokens`` each, short random prompts drawn
from ``--distinct-prompts`` different ones) run with at most ``--concurrency`` in flight. Every
stream is then compared token for token with its prompt's run in isolation (one request alone in
the engine, after the load): a token delivered twice, lost or reordered shows as a difference
(exactly-once delivery). Reported: completions, mismatches, output tokens/s, peak RSS of the
engine process and of every worker process (``VmHWM``, bytes), the engine's RSS at each tenth of
the run (flat memory), and the sizes of the engine's and scheduler's per-request maps afterwards
(bounded: the scheduler keeps at most ``FINISHED_HISTORY`` finished ids).

Prints one JSON line; exit status 1 when a request did not complete or a stream differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams


def _proc_kib(pid: int | str, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of a process from /proc, in bytes (0 when unavailable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def map_sizes(engine: AsyncEngine) -> dict[str, int]:
    """Entries of every per-request map of the engine and its scheduler."""
    s = engine.sched
    return {"engine_streams": len(engine._streams), "engine_step_rows": len(engine._step_rows),
            "sched_live": len(s.queues.live), "sched_finished": len(s.queues.finished),
            "sched_running": s.num_running, "sched_waiting": s.num_waiting,
            "slot_table": len(s.slots._slot_of), "kv_tables": len(s.kv.pool.tables),
            "lifecycle_models": len(s.lifecycle.machine.models)}


async def _collect(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams) -> tuple:
    toks, reason = [], None
    async for out in engine.add_request(rid, ids, params):
        toks += out.new_token_ids
        reason = out.finish_reason or reason
    return tuple(toks), reason


async def load(engine: AsyncEngine, n: int, concurrency: int, distinct: int, max_tokens: int,
               seed: int) -> dict:
    """Run the load on a started engine; returns the report (see the module docstring)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 17))]
               for _ in range(distinct)]
    which = [rng.randrange(distinct) for _ in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)
    results: list[tuple | None] = [None] * n
    rss_marks: list[int] = []
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        async with sem:
            results[i] = await _collect(engine, f"load{i}", prompts[which[i]], params)
        done += 1
        if done % max(1, n // 10) == 0:
            rss_marks.append(_proc_kib("self", "VmRSS"))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.perf_counter() - t0
    alone = [await _collect(engine, f"alone{k}", p, params) for k, p in enumerate(prompts)]
    # a step issued before the last stream was served (the engine sends the next step right after a
    # result) may still be in flight: judge the per-request maps once the pipeline has drained
    for _ in range(1000):
        if not engine.sched.in_flight:
            break
        await asyncio.sleep(0.01)
    mismatched = [i for i, r in enumerate(results) if r != alone[which[i]]]
    incomplete = [i for i, r in enumerate(results)
                  if r is None or r[1] != "length" or len(r[0]) != max_tokens]
    return {"requests": n, "concurrency": concurrency, "distinct_prompts": distinct,
            "completed": n - len(incomplete), "mismatched": len(mismatched),
            "first_mismatches": mismatched[:5], "seconds": round(elapsed, 1),
            "output_tokens_per_s": round(n * max_tokens / elapsed, 1),
            "engine_rss_at_tenths_bytes": rss_marks, "maps_after": map_sizes(engine)}


async def run(config, n: int, concurrency: int, distinct: int, max_tokens: int, seed: int) -> dict:
    """Start an engine, load it, record peak RSS of every process, stop it."""
    engine = await AsyncEngine.start(config)
    try:
        report = await load(engine, n, concurrency, distinct, max_tokens, seed)
        report["peak_rss_bytes"] = {
            "engine": _proc_kib("self", "VmHWM"),
            **{f"rank{r}": _proc_kib(p.pid, "VmHWM")
               for r, p in zip(engine.pool.local_ranks, engine.pool.procs)}}
    finally:
        await engine.shutdown()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--distinct-prompts", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    add_engine_flags(p)
    args = p.parse_args(argv)
    for flag, v in (("--num-requests", args.num_requests), ("--concurrency", args.concurrency),
                    ("--distinct-prompts", args.distinct_prompts), ("--max-tokens", args.max_tokens)):
        if v < 1:
            p.error(f"{flag}: must be >= 1, got {v}")
    report = asyncio.run(run(engine_config(p, args), args.num_requests, args.concurrency,
                             args.distinct_prompts, args.max_tokens, args.seed))
    print(json.dumps(report), flush=True)
    return 0 if report["completed"] == report["requests"] and not report["mismatched"] else 1


if __name__ == "__main__":
    sys.exit(main())
