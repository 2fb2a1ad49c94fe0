"""The engine-core process of ``--api-server-count N``: scheduler, step loop and workers, no HTTP.

With ``--api-server-count N`` the server runs as N API-server processes (HTTP, tokenizing, the
JSON and SSE encoding of every chunk) in front of this one process, which owns the
:class:`~runtime.engine.AsyncEngine` (scheduler, step loop, the worker processes of the pipeline,
detokenizing and stop strings, which decide when a request ends). They talk over ZMQ with msgpack
messages (:mod:`runtime.server.core_messages`): requests and aborts come in on one PULL socket;
the increments of every request go back to the frontend that sent it, batched: all increments
of one engine step leave in one message per frontend.

The process ignores SIGINT (the server's main process decides when to stop) and stops on SIGTERM,
or when the main process is gone: it shuts the engine and its workers down and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import zmq
import zmq.asyncio

from runtime.config import EngineConfig
from runtime.server.core_messages import STATS_INTERVAL_S, decode, encode, pack_output


class EngineCore:
    """One engine behind ZMQ for ``len(pushes)`` frontends.

    No task per request: every live request's engine-side stream gets one shared future as its
    waiter, so the engine's first increment of a step wakes :meth:`flusher` once; it then takes
    the pending increment of every live stream (a cheap scan), sends one message per frontend and
    arms a fresh shared future.
    """

    def __init__(self, engine, pushes: list[zmq.asyncio.Socket]) -> None:
        self.engine = engine
        self.pushes = pushes
        self.live: dict[str, tuple[int, object]] = {}   # req_id -> (frontend, RequestStream)
        self.wake: asyncio.Future = asyncio.get_running_loop().create_future()

    def add(self, frontend: int, req_id: str, prompt: list[int], params: dict,
            fork_of: str | None = None) -> None:
        """Admit one request and start forwarding its increments to ``frontend``."""
        from runtime.engine import EngineDeadError, RequestRejected
        from runtime.engine.faults import RequestFailure
        from runtime.sampling_params import SamplingParams
        try:
            self.engine.add_request(req_id, prompt, SamplingParams.model_validate(params),
                                    fork_of=fork_of)
        except RequestRejected as exc:
            return self._reject(frontend, req_id, exc.field, str(exc), "rejected")
        except RequestFailure as exc:
            return self._reject(frontend, req_id, None, str(exc), "failed")
        except EngineDeadError as exc:
            return self._reject(frontend, req_id, None, str(exc), "dead")
        stream = self.engine._streams[req_id]   # read its increments directly (see the class doc)
        stream._waiter = self.wake
        self.live[req_id] = (frontend, stream)

    def _reject(self, frontend: int, req_id: str, field, message: str, kind: str) -> None:
        self.pushes[frontend].send(encode(["reject", req_id, field, message, kind]))

    async def abort(self, req_id: str) -> None:
        """Abort in the engine; its final increment still goes out (the frontend ignores it)."""
        await self.engine.abort(req_id)

    async def flusher(self) -> None:
        """Send the pending increments, one message per frontend and wake-up."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wake
            self.wake = wake = loop.create_future()
            boxes: list[list] = [[] for _ in self.pushes]
            done = []
            for req_id, (frontend, stream) in self.live.items():
                out = stream._pending
                if out is not None:
                    stream._pending = None
                    boxes[frontend].append(pack_output(out))
                    if out.finished:
                        done.append(req_id)
                stream._waiter = wake
            for req_id in done:
                del self.live[req_id]
            for push, box in zip(self.pushes, boxes):
                if box:
                    await push.send(encode(["outs", box]))

    async def stats_loop(self, stop: asyncio.Event) -> None:
        """The engine's counters to every frontend, every ``STATS_INTERVAL_S``; sets ``stop``
        when the server's main process is gone (its pid is no longer the parent)."""
        parent = os.getppid()
        while True:
            if os.getppid() != parent:
                stop.set()
            alive = bool(self.engine.is_alive)
            try:
                stats = self.engine.stats()
            except Exception:  # noqa: BLE001 - a dead engine may not answer
                stats = {}
            msg = encode(["stats", stats, alive, self.engine.error])
            for push in self.pushes:
                await push.send(msg)
            await asyncio.sleep(STATS_INTERVAL_S)

    async def serve(self, pull: zmq.asyncio.Socket) -> None:
        """Handle frontend messages until cancelled."""
        while True:
            msg = decode(await pull.recv())
            if msg[0] == "add":
                self.add(int(msg[1]), msg[2], msg[3], msg[4], msg[5])
            elif msg[0] == "abort":
                await self.abort(msg[1])


def _info(engine) -> dict:
    sc = engine.sched.config
    return {"model_name": engine.model_name, "vocab_size": engine.tokenizer.vocab_size,
            "num_kv_blocks": sc.num_kv_blocks, "block_size": sc.block_size,
            "pid": os.getpid()}


async def run_core(config: EngineConfig, in_addr: str, out_addrs: list[str]) -> int:
    """Start the engine, serve the frontends until SIGTERM; returns the exit status."""
    from runtime.engine import AsyncEngine
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    pushes = []
    for addr in out_addrs:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(addr)
        pushes.append(s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        start = asyncio.create_task(AsyncEngine.start(config))
        done, _ = await asyncio.wait([start, asyncio.create_task(stop.wait())],
                                     return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return 0
        engine = start.result()
    except Exception as exc:  # noqa: BLE001 - reported to the frontends, which exit 1
        for s in pushes:
            s.send(encode(["dead", f"engine failed to start: {exc}"]))
        await asyncio.sleep(0.5)
        return 1
    core = EngineCore(engine, pushes)
    for s in pushes:
        await s.send(encode(["ready", _info(engine)]))
    tasks = [asyncio.create_task(t) for t in (core.serve(pull), core.flusher(), core.stats_loop(stop))]
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.shutdown()
        for s in [pull, *pushes]:
            s.close(linger=0)
        ctx.term()
    return 0


def core_main(config: EngineConfig, in_addr: str, out_addrs: list[str],
              supervisor_pid: int | None = None) -> None:
    """Process entry point (``multiprocessing`` spawn target); exits (and its ranks with it) when
    process ``supervisor_pid`` ends (None: not watched)."""
    from runtime.engine.rank_process import watch_engine
    os.setpgid(0, 0)   # a Ctrl-C on the terminal reaches the main process only
    if supervisor_pid is not None:   # own process group: a SIGKILL of the supervisor left it
        watch_engine(supervisor_pid, who="engine core", watched="supervisor")  # and its ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(asyncio.run(run_core(config, in_addr, out_addrs)))
