"""Engine start time with ranks forked from the torch-preloading forkserver vs spawned (CI time,
runtime/engine/rank_process.py), alternated start by start in one process:

    PYTHONPATH=$PWD python benchmarks/engine_start.py [--rounds 4] [--pp 2] [--out FILE.json]

Each start is ``AsyncEngine.start`` (EngineConfig(pp_size=PP), the default model, the CPU) up to
every rank ready, then ``shutdown``; "spawn" swaps the launcher's context for
``multiprocessing.get_context("spawn")``. The first forkserver start also starts the forkserver
(its torch import); it is reported on its own and left out of the median.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time

from runtime.bench.results import write_result
from runtime.config import EngineConfig
from runtime.engine import AsyncEngine, launcher
from runtime.engine.rank_process import rank_context


async def one_start(pp: int) -> tuple[float, float]:
    """(seconds to ready, seconds to shut down) of one engine."""
    t0 = time.perf_counter()
    engine = await AsyncEngine.start(EngineConfig(pp_size=pp))
    t1 = time.perf_counter()
    await engine.shutdown()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/engine-start-cpu.json")
    a = p.parse_args()
    contexts = {"forkserver": rank_context, "spawn": lambda: mp.get_context("spawn")}
    runs: dict[str, list[dict]] = {k: [] for k in contexts}
    for r in range(a.rounds):
        for name in (("forkserver", "spawn") if r % 2 == 0 else ("spawn", "forkserver")):
            launcher.rank_context = contexts[name]
            ready, down = asyncio.run(one_start(a.pp))
            runs[name].append({"round": r, "ready_s": round(ready, 3), "shutdown_s": round(down, 3),
                               "loadavg_1m": os.getloadavg()[0]})
            print(f"round {r} {name:10s} ready {ready:6.2f} s  shutdown {down:5.2f} s  "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    warm = {k: [x["ready_s"] for x in v[1:] if k == "forkserver"] or [x["ready_s"] for x in v]
            for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in warm.items()}
    results = {"runs": runs, "first_forkserver_start_s": runs["forkserver"][0]["ready_s"],
               "median_ready_s": med, "ratio_forkserver_over_spawn": round(med["forkserver"] / med["spawn"], 3)}
    print(results["median_ready_s"], results["ratio_forkserver_over_spawn"])
    write_result(a.out, "engine_start", results, vars(a), "PYTHONPATH=$PWD python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
