"""Timed requests and workloads on a running engine, shared by the engine benchmarks
(``python -m runtime.bench pp``, its ``--overheads`` and the serving benchmarks): one streamed
request's TTFT / TPOT, a batch of concurrent requests' throughput and per-rank busy seconds, and the
pairwise ratios of two engines' rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams


async def timed_request(engine: AsyncEngine, rid: str, ids: list[int], max_tokens: int) -> dict:
    """Stream one greedy request (EOS ignored): TTFT, TPOT (seconds) and its token count."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return await stream_timed(engine, rid, ids, params)


async def stream_timed(engine: AsyncEngine, rid: str, ids: list[int],
                       params: SamplingParams) -> dict:
    """Stream one request: ``ttft_s`` and ``tpot_s`` (seconds) and its token count ``tokens``."""
    t0 = time.perf_counter()
    first, n = None, 0
    async for out in engine.add_request(rid, ids, params):
        if out.new_token_ids and first is None:
            first = time.perf_counter()
        n += len(out.new_token_ids)
    end = time.perf_counter()
    tpot = (end - first) / (n - 1) if n > 1 and first else 0.0
    return {"ttft_s": (first or end) - t0, "tpot_s": tpot, "tokens": n}


async def run_workload(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int,
                       tag: str) -> dict:
    """All ``prompts`` at once on a warm engine: throughput, TTFT and per-rank busy s per step."""
    s0 = engine.stats()
    t0 = time.perf_counter()
    res = await asyncio.gather(*(timed_request(engine, f"{tag}-{i}", p, max_tokens)
                                 for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    tokens = sum(r["tokens"] for r in res)
    steps = s1["steps_total"] - s0["steps_total"]
    busy = [b - a for a, b in zip(s0["rank_busy_seconds"], s1["rank_busy_seconds"])]
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "mean_ttft_s": statistics.mean(r["ttft_s"] for r in res),
            "max_ttft_s": max(r["ttft_s"] for r in res),
            "mean_tpot_s": statistics.mean(r["tpot_s"] for r in res), "steps": steps,
            "rank_busy_s": busy, "busy_s_per_step": [b / max(1, steps) for b in busy],
            "rank_busy_fraction": [b / wall for b in busy]}


def ratio_summary(a: list[float], b: list[float]) -> dict:
    """Pairwise ratios a[i] / b[i]: median, min, max and all of them."""
    r = [x / y for x, y in zip(a, b) if y]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "all": r} if r else {}
