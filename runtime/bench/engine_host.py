"""``python -m runtime.bench.engine_host``: the engine process's own host cost per step.

Runs the real :class:`~runtime.engine.AsyncEngine` (scheduler, step and result messages through
msgpack, detokenizer, per-request streams, streaming clients) with its worker pool replaced by
:class:`InstantPool`, a stand-in last rank inside the engine's process that answers every step at
once: it encodes the step message as :meth:`WorkerPool.send_step` does, and replies with a result
message (token id ``(slot * 7919 + step) % 30000 + 100`` per sampled row) encoded as a worker
would. No model runs, so the wall time is the engine process's work alone: the upper bound of
the engine's throughput whatever the GPU does (at PP=1 the GPU step of SmolLM2 at 256 rows takes
~1.3 ms, docs/gpu.md). ``--transport zmq`` sends the steps and answers over ipc sockets, the
answers read by the real :meth:`WorkerPool.recv` (default ``queue``: an ``asyncio.Queue``, no
sockets). ``--profile FILE`` writes a cProfile of the timed part.

Figures: ``engine_s_per_step`` (seconds of engine wall per step) and ``tokens_per_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import random
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from runtime import transport as tp
from runtime.bench.pp import stream_timed
from runtime.config import EngineConfig
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.heap import freeze_startup_heap
from runtime.engine.launcher import WorkerPool
from runtime.engine.plan import plan_pipeline
from runtime.model.tokenizer import load_tokenizer
from runtime.sampling_params import SamplingParams


class InstantPool:
    """A :class:`~runtime.engine.launcher.WorkerPool` stand-in: one rank in-process that answers
    each step at once (no model). Steps and results still pass through their msgpack bytes.

    Args:
        transport: ``"queue"``: the answers wait in an ``asyncio.Queue``; ``"zmq"``: steps go out
            on a PUSH socket and the answers come back over an ipc PUSH/PULL pair, read by the real
            :meth:`WorkerPool.recv` (the engine's side of the sockets as in a real run).
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, transport: str = "queue") -> None:
        self.config, self.plan = config, plan_pipeline(config)
        self.num_kv_blocks = num_kv_blocks
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.bytes_sent = 0
        self._zmq = transport == "zmq"
        if self._zmq:
            self.ctx, self.sync_ctx = zmq.asyncio.Context(), zmq.Context()
            res, step = tp.ipc_address("host-res"), tp.ipc_address("host-step")
            self._pull = tp.make_pull(self.ctx, res, bind=True)
            self._answer = tp.make_push(self.sync_ctx, res, bind=False)
            self._step_sink = tp.make_pull(self.sync_ctx, step, bind=True)   # never read
            self._push = [tp.make_push(self.sync_ctx, step, bind=False, linger_ms=0)]
            self.last_heard = [time.monotonic()] * config.scheduler.pp_size

    def send_step(self, out) -> None:
        """Encode (and with zmq send) ``out`` as the real pool does; queue the rank's answer."""
        data = tp.encode(tp.from_scheduler_output(out))
        self.bytes_sent += len(data)
        n = out.num_rows
        ids = ((out.slots.astype(np.int64) * 7919 + out.step) % 30000 + 100).reshape(n, 1)
        res = tp.ResultMsg(step=out.step, rank=self.config.scheduler.pp_size - 1, busy_s=0.0,
                           sampled_token_ids=tp.NdArray.of(ids),
                           num_sampled=tp.NdArray.of(out.is_final_chunk.astype(np.int32)),
                           num_rejected=tp.NdArray.of(np.zeros(n, np.int32)))
        if self._zmq:
            self._push[0].send(data, zmq.NOBLOCK, copy=False)
            self._answer.send(tp.encode(res))
        else:
            self._queue.put_nowait(tp.encode(res))

    async def recv(self, timeout_s: float):
        """The next queued answer, decoded; None after ``timeout_s`` seconds (0: no wait)."""
        if self._zmq:
            return await WorkerPool.recv(self, timeout_s)
        try:
            data = await asyncio.wait_for(self._queue.get(), timeout_s) if timeout_s > 0 \
                else self._queue.get_nowait()
        except (asyncio.TimeoutError, asyncio.QueueEmpty):
            return None
        return tp.decode(data)

    @staticmethod
    def to_step_result(msg):
        return tp.to_step_result(msg)

    def dead_ranks(self) -> list[int]:
        """No processes: never any."""
        return []

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """No processes: never any."""
        return []

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """No processes to stop; the sockets (zmq) are closed."""
        if self._zmq:
            self.ctx.destroy(linger=0)
            self.sync_ctx.destroy(linger=0)


async def run(config: EngineConfig, prompts: list[list[int]], max_tokens: int,
              profile: str | None, transport: str = "queue") -> dict:
    """Start the engine over an :class:`InstantPool`, warm it up, run every prompt at once."""
    sc = config.scheduler
    blocks = len(prompts) * -(-(len(prompts[0]) + max_tokens) // sc.block_size) + 64
    pool = InstantPool(config, blocks, transport)
    engine = AsyncEngine(config, pool, load_tokenizer(pool.plan.model_path))
    freeze_startup_heap()  # as AsyncEngine.start does
    engine._tasks = [asyncio.create_task(engine._step_loop()),
                     asyncio.create_task(engine._result_loop())]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        await stream_timed(engine, "warmup", prompts[0], SamplingParams(max_tokens=4))
        s0 = engine.stats()["steps_total"]
        prof = cProfile.Profile() if profile else None
        t0, c0 = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        res = await asyncio.gather(*(stream_timed(engine, f"b{i}", p, params)
                                     for i, p in enumerate(prompts)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if prof:
            prof.disable()
            prof.dump_stats(profile)
        steps = engine.stats()["steps_total"] - s0
    finally:
        await engine.shutdown()
    tokens = sum(r["tokens"] for r in res)
    return {"rows": len(prompts), "mode": sc.mode, "transport": transport, "steps": steps, "wall_s": wall,
            "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "engine_s_per_step": wall / max(1, steps),
            "engine_cpu_s_per_step": cpu / max(1, steps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.engine_host", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256],
                   help="concurrent requests (= max_num_seqs), one run each")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default="default", help="model whose tokenizer the engine uses")
    p.add_argument("--mode", default="overlapped", choices=["overlapped", "sync"])
    p.add_argument("--repeat", type=int, default=1, help="runs per row count (best reported)")
    p.add_argument("--transport", default="queue", choices=["queue", "zmq"],
                   help="how the stand-in rank's answers reach the engine (see InstantPool)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="cProfile of the last run's timed part (FILE.ROWS)")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    rng = random.Random(0)
    results = []
    for rows in args.rows:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(rows)]
        cfg = EngineConfig(model=args.model, pp_size=1, max_num_seqs=rows, max_model_len=args.prompt_len
                           + args.max_tokens + 16, mode=args.mode,
                           max_num_batched_tokens=max(4096, rows * args.prompt_len),
                           max_prefill_chunk=max(4096, rows * args.prompt_len))
        runs = [asyncio.run(run(cfg, prompts, args.max_tokens,
                                f"{args.profile}.{rows}" if args.profile and i == args.repeat - 1
                                else None, args.transport))
                for i in range(args.repeat)]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        best["all_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
        results.append(best)
        print(f"rows {rows}: {best['tokens_per_s']:,.0f} tok/s, "
              f"{1e3 * best['engine_s_per_step']:.2f} ms engine per step, "
              f"{1e3 * best['engine_cpu_s_per_step']:.2f} ms CPU "
              f"({best['steps']} steps)", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
