"""``python -m runtime.bench.faults``: how fast the engine notices a killed, frozen or stalled
rank, and how fast ``--restart-workers`` serves again (issue #12, item 1).

For each ``--faults`` kind (``SIGKILL``, ``SIGSTOP``): start an engine, run ``--requests`` greedy
streams until they decode, send the signal to ``--rank``'s process, and measure the seconds until
every stream ended with an error (``detect_s``) and until every worker process is gone
(``all_exited_s``). ``STALL`` / ``DEADLOCK``: the ``PPSTATE_TEST_STALL`` hook makes ``--rank``
sleep in ``forward`` / ``recv`` of its 4th decode-only step while its heartbeat goes on;
``detect_s`` is then the time the rank spent in that phase when the engine gave up (from the
engine's verdict). ``RESTART``: SIGKILL under the restart supervisor; ``restart_s`` is the time
from the kill until a fresh engine serves, and ``after_restart_tokens`` the tokens of one request
served by it. Prints one JSON line per fault; exit status 1 when a stream ended without an error
or a worker outlived the shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time

from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams
from runtime.engine.supervisor import EngineSupervisor
from runtime.worker.progress import STALL_ENV

HOOK_PHASE = {"STALL": "forward", "DEADLOCK": "recv"}


async def _stream(engine: AsyncEngine, rid: str, params: SamplingParams) -> tuple[int, str | None]:
    n, error = 0, None
    async for out in engine.add_request(rid, [100 + i for i in range(8)], params):
        n += len(out.new_token_ids)
        error = out.error or error
    return n, error


async def measure(config, fault: str, rank: int, n_requests: int) -> dict:
    """One engine, one fault; returns the timings and the error the streams got."""
    if fault in HOOK_PHASE:
        os.environ[STALL_ENV] = f"{rank}:{HOOK_PHASE[fault]}:4"   # read by the spawned ranks
    try:
        engine = await (EngineSupervisor.start(config, max_restarts=1, backoff_s=0.0)
                        if fault == "RESTART" else AsyncEngine.start(config))
    finally:
        os.environ.pop(STALL_ENV, None)
    inner = engine.engine if fault == "RESTART" else engine
    procs = list(inner.pool.procs)
    params = SamplingParams(max_tokens=config.scheduler.max_model_len - 16, temperature=0.0, ignore_eos=True)
    tasks = [asyncio.ensure_future(_stream(engine, f"f{i}", params)) for i in range(n_requests)]
    if fault not in HOOK_PHASE:
        while engine.stats()["generated_tokens_total"] < 2 * n_requests:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        os.kill(procs[rank].pid, getattr(signal, "SIGKILL" if fault == "RESTART" else fault))
    results = await asyncio.gather(*tasks)
    detect = time.monotonic() - t0 if fault not in HOOK_PHASE else None
    error = inner.error
    if fault in HOOK_PHASE:  # the engine's verdict says how long the phase had lasted
        detect = float(re.search(rf"rank {rank}[^(]* for ([\d.]+) s", error or "").group(1))
        t0 = time.monotonic() - detect
    extra = {}
    if fault == "RESTART":
        while not engine.is_alive:
            await asyncio.sleep(0.01)
        extra["restart_s"] = round(time.monotonic() - t0, 2)
        extra["after_restart_tokens"] = (await _stream(engine, "after", SamplingParams(
            max_tokens=8, temperature=0.0, ignore_eos=True)))[0]
    await engine.shutdown()
    exited = time.monotonic() - t0
    return {"fault": fault, "rank": rank, "detect_s": round(detect, 2), "all_exited_s": round(exited, 2),
            "streams_with_error": sum(e is not None for _, e in results), "streams": n_requests,
            "workers_alive_after": sum(p.is_alive() for p in procs), "error": error, **extra}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="SIGKILL,SIGSTOP,STALL,DEADLOCK,RESTART",
                   help="comma list of signals (SIGKILL, SIGSTOP, ...), STALL, DEADLOCK, RESTART")
    p.add_argument("--rank", type=int, default=1, help="the rank to hit")
    p.add_argument("--requests", type=int, default=4)
    add_engine_flags(p)
    args = p.parse_args(argv)
    config = engine_config(p, args)
    if not 0 <= args.rank < config.scheduler.pp_size:
        p.error(f"--rank: must be in 0..{config.scheduler.pp_size - 1}")
    status = 0
    for fault in args.faults.split(","):
        if not hasattr(signal, fault) and fault not in ("STALL", "DEADLOCK", "RESTART"):
            p.error(f"--faults: unknown signal {fault!r}")
        r = asyncio.run(measure(config, fault, args.rank, args.requests))
        print(json.dumps(r), flush=True)
        status |= int(r["streams_with_error"] != r["streams"] or r["workers_alive_after"] > 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
