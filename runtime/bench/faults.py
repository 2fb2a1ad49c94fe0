"""``python -m runtime.bench.faults``: how fast the engine notices a killed or frozen rank
(issue #12, item 1).

For each ``--faults`` kind (``SIGKILL``, ``SIGSTOP``): start an engine, run ``--requests`` greedy
streams until they decode, send the signal to ``--rank``'s process, and measure the seconds until
every stream ended with an error (``detect_s``) and until every worker process is gone
(``all_exited_s``). Prints one JSON line per fault; exit status 1 when a stream ended without an
error or a worker outlived the shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams


async def _stream(engine: AsyncEngine, rid: str, params: SamplingParams) -> tuple[int, str | None]:
    n, error = 0, None
    async for out in engine.add_request(rid, [100 + i for i in range(8)], params):
        n += len(out.new_token_ids)
        error = out.error or error
    return n, error


async def measure(config, fault: str, rank: int, n_requests: int) -> dict:
    """One engine, one fault; returns the timings and the error the streams got."""
    engine = await AsyncEngine.start(config)
    procs = list(engine.pool.procs)
    params = SamplingParams(max_tokens=config.scheduler.max_model_len - 16, temperature=0.0, ignore_eos=True)
    tasks = [asyncio.ensure_future(_stream(engine, f"f{i}", params)) for i in range(n_requests)]
    while engine.stats()["generated_tokens_total"] < 2 * n_requests:
        await asyncio.sleep(0.01)
    t0 = time.monotonic()
    os.kill(procs[rank].pid, getattr(signal, fault))
    results = await asyncio.gather(*tasks)
    detect = time.monotonic() - t0
    await engine.shutdown()
    exited = time.monotonic() - t0
    return {"fault": fault, "rank": rank, "detect_s": round(detect, 2), "all_exited_s": round(exited, 2),
            "streams_with_error": sum(e is not None for _, e in results), "streams": n_requests,
            "workers_alive_after": sum(p.is_alive() for p in procs), "error": engine.error}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="SIGKILL,SIGSTOP", help="comma list of signals")
    p.add_argument("--rank", type=int, default=1, help="the rank to hit")
    p.add_argument("--requests", type=int, default=4)
    add_engine_flags(p)
    args = p.parse_args(argv)
    config = engine_config(p, args)
    if not 0 <= args.rank < config.scheduler.pp_size:
        p.error(f"--rank: must be in 0..{config.scheduler.pp_size - 1}")
    status = 0
    for fault in args.faults.split(","):
        if not hasattr(signal, fault):
            p.error(f"--faults: unknown signal {fault!r}")
        r = asyncio.run(measure(config, fault, args.rank, args.requests))
        print(json.dumps(r), flush=True)
        status |= int(r["streams_with_error"] != r["streams"] or r["workers_alive_after"] > 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
