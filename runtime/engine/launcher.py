"""WorkerPool: the engine's side of the worker processes (one per rank: ``pp x tp`` of them, global
rank ``pp_rank * tp + tp_rank``, docs/tp.md), talked to over zmq.

Engine -> rank r: a PUSH socket per rank carrying step and control messages.
Ranks -> engine: one PULL socket carrying ready, result and error messages.
All messages are msgspec/msgpack (:mod:`runtime.transport`); nothing is unpickled.

``launcher="spawn"``: every rank is started here (forked from a forkserver that has torch imported,
:mod:`runtime.engine.rank_process`); sockets are ipc, the rendezvous a free local port.
``launcher="torchrun"``: only rank 0 is started here (``env://`` rendezvous); ranks > 0 are the
other torchrun processes (:mod:`runtime.engine.torchrun`), so the sockets are TCP on every interface at
``engine_port`` (results) and ``engine_port + 1 + rank`` (steps), and the pool pings every rank
each :data:`runtime.engine.torchrun.HEARTBEAT_S` seconds so that orphaned workers can exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

import zmq
import zmq.asyncio

from ppstate.batch import SchedulerOutput, StepResult
from runtime import transport as tp
from runtime.config import EngineConfig
from runtime.engine.plan import PipelinePlan, WorkerArgs
from runtime.engine.rank_process import engine_cpus, forkserver_gone, rank_context, rank_entry
from runtime.engine.torchrun import HEARTBEAT_S


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the torch rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerPool:
    """The worker processes of one pipeline.

    Args:
        config: engine configuration (pp_size, launcher, ports, ...).
        plan: the model and layer ranges (:func:`runtime.engine.plan.plan_pipeline`).
    """

    def __init__(self, config: EngineConfig, plan: PipelinePlan) -> None:
        self.config, self.plan = config, plan
        self.ctx = zmq.asyncio.Context()   # the result PULL socket (awaited)
        self.sync_ctx = zmq.Context()      # step PUSH sockets (never block: no high-water mark)
        self.torchrun = config.launcher == "torchrun"
        self.local_ranks = [0] if self.torchrun else list(range(config.world_size))
        self.procs: list[mp.Process] = []
        self._push: list[zmq.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._heartbeat: asyncio.Task | None = None
        self._shutdown_task: asyncio.Task | None = None
        self.num_kv_blocks: int | None = None  # smallest KV block count the ranks reported
        self.ready_info: dict[int, dict] = {}   # rank -> its ReadyMsg info (layers, CUDA graphs)
        self.last_heard = [time.monotonic()] * config.world_size  # [pp x tp] monotonic s, any message

    def _addresses(self) -> tuple[str, list[str], str]:
        """(result bind address, step bind address per rank, rendezvous URL)."""
        if self.torchrun:
            port = self.config.engine_port
            return (f"tcp://*:{port}", [f"tcp://*:{port + 1 + r}" for r in range(self.config.world_size)],
                    "env://")
        tag = f"{time.time_ns()}"
        return (tp.ipc_address(f"res-{tag}"),
                [tp.ipc_address(f"step{r}-{tag}") for r in range(self.config.world_size)],
                f"tcp://127.0.0.1:{free_port()}")

    async def start(self, ready_timeout_s: float = 600.0) -> None:
        """Bind the sockets, spawn the local ranks and wait until every rank reports ready.

        Raises:
            RuntimeError: a rank reported an error or died, or the timeout passed.
            TransportError: a TCP port (torchrun) is in use.
        """
        result_addr, step_addrs, init = self._addresses()
        self._pull = tp.make_pull(self.ctx, result_addr, bind=True)
        for a in step_addrs:  # appended one by one: shutdown must close every socket it made
            self._push.append(tp.make_push(self.sync_ctx, a, bind=True, linger_ms=0))
        if self.torchrun:
            self._heartbeat = asyncio.ensure_future(self._ping_loop())
        ctx = rank_context()
        for rank in self.local_ranks:  # a local rank connects to a "*" bind via the loopback
            args = WorkerArgs(rank, self.config.model_dump(), tuple(self.plan.layer_ranges[rank // self.config.tp_size]),
                              str(self.plan.model_path), init, step_addrs[rank].replace("*", "127.0.0.1"),
                              result_addr.replace("*", "127.0.0.1"))
            proc = ctx.Process(target=rank_entry, name=f"ppstate-rank{rank}", daemon=True,
                               args=(_worker_entry, args, dict(os.environ), engine_cpus(), os.getpid()))
            _start_ignoring_sigint(proc, ctx)
            self.procs.append(proc)
        await self._wait_ready(ready_timeout_s)

    async def _ping_loop(self) -> None:
        ping = tp.encode(tp.ControlMsg(kind="ping"))
        while True:
            for s in self._push:
                try:
                    s.send(ping, zmq.NOBLOCK)
                except zmq.ZMQError:  # rank not connected (yet): nothing to keep alive
                    pass
            await asyncio.sleep(HEARTBEAT_S)

    async def _wait_ready(self, timeout_s: float) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.config.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(self.config.world_size)) - ready)} not "
                                   f"ready within {timeout_s:.0f} s")
            msg = await self.recv(timeout_s=1.0)
            if msg is None:
                if self.dead_ranks():
                    raise RuntimeError(f"worker rank(s) {self.dead_ranks()} died while loading")
                continue
            if msg.kind == "error":
                raise RuntimeError(f"rank {msg.rank}: {msg.error_type}: {msg.message}")
            if msg.kind == "ready":
                ready.add(msg.rank)
                self.ready_info[msg.rank] = dict(msg.info)
                self.last_heard = [time.monotonic()] * self.config.world_size
                blocks = msg.info.get("num_kv_blocks")
                if blocks is not None:
                    self.num_kv_blocks = min(self.num_kv_blocks or blocks, int(blocks))

    def send_step(self, out: SchedulerOutput) -> None:
        """Send one step to every rank (same bytes to all: the replicated decision input).

        Raises:
            RuntimeError: a rank's socket has no peer (its process is gone); never blocks.
        """
        data = tp.encode(tp.from_scheduler_output(out))
        for rank, s in enumerate(self._push):
            try:
                s.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                raise RuntimeError(f"rank {rank} is not connected (its process is gone)") from None

    def send_control(self, rank: int, msg) -> None:
        """Send a control message (e.g. a test's state corruption) to one rank."""
        self._push[rank].send(tp.encode(msg))

    async def recv(self, timeout_s: float):
        """Next message from any rank, or None after ``timeout_s`` seconds. Every message
        (heartbeats included) updates its rank's :attr:`last_heard`."""
        try:  # a message already queued is read at once: the poller's futures and loop round
            frame = await self._pull.recv(zmq.NOBLOCK, copy=False)  # cost ~0.2 ms a message
        except zmq.Again:
            if timeout_s <= 0 or await self._pull.poll(int(timeout_s * 1000)) == 0:
                return None
            frame = await self._pull.recv(copy=False)
        msg = tp.decode(frame.buffer)
        rank = getattr(msg, "rank", None)
        if isinstance(rank, int) and 0 <= rank < len(self.last_heard):
            self.last_heard[rank] = time.monotonic()
        return msg

    def silent_ranks(self, timeout_s: float) -> list[int]:
        """Ranks that sent nothing (not even a heartbeat) for more than ``timeout_s`` seconds:
        killed, frozen (SIGSTOP), or unreachable."""
        now = time.monotonic()
        return [r for r, t in enumerate(self.last_heard) if now - t > timeout_s]

    @staticmethod
    def to_step_result(msg) -> StepResult:
        return tp.to_step_result(msg)

    def dead_ranks(self) -> list[int]:
        """Ranks whose local process exited (torchrun ranks > 0 report errors themselves)."""
        return [r for r, p in zip(self.local_ranks, self.procs) if not p.is_alive()]

    def exited_by_itself(self, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` (from :meth:`dead_ranks`) ended with an exit status,
        not a signal: such a rank may have sent its error report just before it exited."""
        procs = dict(zip(self.local_ranks, self.procs))
        return all((procs[r].exitcode or 0) >= 0 for r in ranks)

    def describe_dead(self, ranks: list[int]) -> str:
        """``"worker process of rank(s) [1] died (rank 1: killed by SIGKILL)"``: how each of
        ``ranks`` (local ranks, from :meth:`dead_ranks`) ended, from its exit code."""
        procs = dict(zip(self.local_ranks, self.procs))
        how = [f"rank {r}: {describe_exit(procs[r].exitcode)}" for r in ranks]
        return f"worker process of rank(s) {ranks} died ({'; '.join(how)})"

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every rank to stop, then terminate / kill stragglers, close every socket.
        Idempotent: a second caller waits for the first shutdown to finish."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(grace_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace_s: float) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for s in self._push:
            try:
                s.send(tp.encode(tp.ControlMsg(kind="shutdown")), zmq.NOBLOCK)
            except zmq.ZMQError:  # rank gone: nothing to tell
                pass
        deadline = time.monotonic() + grace_s
        while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                with contextlib.suppress(ProcessLookupError):  # a frozen (SIGSTOP) rank takes
                    os.kill(p.pid, signal.SIGCONT)             # its SIGTERM only once continued
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        if self.torchrun:  # let the shutdown messages reach the remote ranks (at most grace_s)
            for s in self._push:
                s.close(linger=int(grace_s * 1000))
            await asyncio.to_thread(self.sync_ctx.term)
        self.ctx.destroy(linger=0)
        if not self.sync_ctx.closed:
            self.sync_ctx.destroy(linger=0)


def describe_exit(code: int | None) -> str:
    """How a rank process ended, from its ``Process.exitcode``: ``"killed by SIGKILL"``,
    ``"exit status 3"``; 255 while the ranks' forkserver is gone is multiprocessing's "unknown"
    (the forkserver reports the status), and is said so."""
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 255 and forkserver_gone(wait_s=1.0):
        return "exit status unknown: the ranks' forkserver, which reports it, is gone"
    return f"exit status {code}"


def _start_ignoring_sigint(proc: mp.Process, ctx: BaseContext) -> None:
    """Start ``proc`` (of context ``ctx``) so that the process started for it inherits SIGINT
    ignored: the forkserver, or a spawned interpreter. The rank itself ignores SIGINT too
    (:func:`~runtime.engine.rank_process.rank_entry`): Ctrl-C reaches the engine, which shuts
    the workers down in order, instead of every worker raising KeyboardInterrupt.

    Only the spawning happens with SIGINT ignored here: the first rank forked from a fresh
    forkserver waits for its preload (torch: seconds), and a Ctrl-C ignored all that time was
    lost (the server went on to serve); :func:`multiprocessing.forkserver.ensure_running` spawns
    the forkserver without waiting for it."""
    if threading.current_thread() is not threading.main_thread():
        proc.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if ctx.get_start_method() != "forkserver":
            proc.start()
            return
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
    proc.start()   # forked by the forkserver, which ignores SIGINT: Ctrl-C stays handled here


def _worker_entry(args: WorkerArgs) -> None:
    from runtime.worker.main import run_worker
    run_worker(args)
