"""WorkerPool: the engine's side of the worker processes (one per PP rank), talked to over zmq.

Engine -> rank r: a PUSH socket per rank carrying step and control messages.
Ranks -> engine: one PULL socket carrying ready, result and error messages.
All messages are msgspec/msgpack (:mod:`runtime.transport`); nothing is unpickled.

``launcher="spawn"``: every rank is spawned here; sockets are ipc, the rendezvous a free local port.
``launcher="torchrun"``: only rank 0 is spawned here (``env://`` rendezvous); ranks > 0 are the
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
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ppstate.batch import SchedulerOutput, StepResult
from runtime import transport as tp
from runtime.config import EngineConfig, parse_kv_memory
from runtime.model.config import ModelConfig
from runtime.model.partition import parse_partition, split_layers
from runtime.model.registry import resolve_model_path
from runtime.model.stage import load_model_config


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the torch rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker process needs (passed to the spawned process by multiprocessing)."""
    rank: int
    config: dict
    layer_range: tuple[int, int]
    model_path: str
    init_method: str
    step_addr: str
    result_addr: str
    idle_exit_s: float | None = None  # exit after this many seconds without an engine message


def plan_layers(config: EngineConfig, model_cfg: ModelConfig) -> list[tuple[int, int]]:
    """The ``(start, end)`` layers of every rank: ``--pp-layer-partition`` or the cost-balanced
    split. Deterministic, so torchrun ranks compute it locally without a handshake.

    Raises:
        ValueError: bad ``pp_layer_partition`` (message names ``--pp-layer-partition``).
    """
    n, pp = model_cfg.num_layers, config.pp_size
    return (parse_partition(config.pp_layer_partition, n, pp) if config.pp_layer_partition
            else split_layers(n, pp, model_cfg))


def check_resources(config: EngineConfig, model_cfg: ModelConfig) -> None:
    """Refuse, before any process starts, configurations that cannot work.

    Raises:
        ValueError: ``max_model_len`` beyond the model's context, CUDA asked for but absent, or
            (on CPU) KV caches larger than 80% of this machine's memory, or a fractional
            ``--kv-cache-memory`` without CUDA; names the flag.
    """
    if config.max_model_len > model_cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len: {config.max_model_len} exceeds the model's context "
                         f"length {model_cfg.max_position_embeddings}")
    import torch
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda was asked for but torch sees no CUDA device "
                         f"(torch {torch.__version__})")
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if config.kv_cache_memory is not None:
        size, _ = parse_kv_memory(config.kv_cache_memory)
        if size is None:
            raise ValueError(f"--kv-cache-memory: a fraction ({config.kv_cache_memory}) needs a "
                             "CUDA device; give a size such as 24MB on the CPU")
        if size * config.pp_size > 0.8 * mem:
            raise ValueError(f"--kv-cache-memory: {config.pp_size} ranks x "
                             f"{config.kv_cache_memory} is more than 80% of this machine's "
                             f"{mem / 2**30:.1f} GiB")
        return
    elem = 2 if config.dtype in ("bfloat16", "float16") else 4
    kv = (2 * model_cfg.num_layers * config.max_num_seqs * model_cfg.num_kv_heads
          * (-(-config.max_model_len // config.block_size) * config.block_size)
          * model_cfg.head_dim * elem)
    if kv > 0.8 * mem:
        raise ValueError(
            f"--max-model-len / --max-num-seqs: KV caches of {config.max_num_seqs} x "
            f"{config.max_model_len} tokens need {kv / 2**30:.1f} GiB, more than 80% of this "
            f"machine's {mem / 2**30:.1f} GiB")


class WorkerPool:
    """The worker processes of one pipeline.

    Args:
        config: engine configuration (pp_size, model, partition, ...).

    Raises:
        ValueError: bad ``pp_layer_partition`` (message names ``--pp-layer-partition``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_cfg = load_model_config(self.model_path)
        check_resources(config, self.model_cfg)
        self.model_name = served_name(self.model_path)
        self.layer_ranges = plan_layers(config, self.model_cfg)
        self.ctx = zmq.asyncio.Context()   # the result PULL socket (awaited)
        self.sync_ctx = zmq.Context()      # step PUSH sockets (never block: no high-water mark)
        self.torchrun = config.launcher == "torchrun"
        self.local_ranks = [0] if self.torchrun else list(range(config.pp_size))
        self.procs: list[mp.Process] = []
        self._push: list[zmq.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._heartbeat: asyncio.Task | None = None
        self._shutdown_task: asyncio.Task | None = None
        self.num_kv_blocks: int | None = None  # smallest KV block count the ranks reported
        self.last_heard = [time.monotonic()] * config.pp_size  # [pp_size] monotonic s, any message

    def _addresses(self) -> tuple[str, list[str], str]:
        """(result bind address, step bind address per rank, rendezvous URL)."""
        if self.torchrun:
            port = self.config.engine_port
            return (f"tcp://*:{port}", [f"tcp://*:{port + 1 + r}" for r in range(self.config.pp_size)],
                    "env://")
        tag = f"{time.time_ns()}"
        return (tp.ipc_address(f"res-{tag}"),
                [tp.ipc_address(f"step{r}-{tag}") for r in range(self.config.pp_size)],
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
        spawn = mp.get_context("spawn")
        for rank in self.local_ranks:  # a local rank connects to a "*" bind via the loopback
            args = WorkerArgs(rank, self.config.model_dump(), tuple(self.layer_ranges[rank]),
                              str(self.model_path), init, step_addrs[rank].replace("*", "127.0.0.1"),
                              result_addr.replace("*", "127.0.0.1"))
            proc = spawn.Process(target=_worker_entry, args=(args,), name=f"ppstate-rank{rank}",
                                 daemon=True)
            _start_ignoring_sigint(proc)
            self.procs.append(proc)
        await self._wait_ready(ready_timeout_s)

    async def _ping_loop(self) -> None:
        from runtime.engine.torchrun import HEARTBEAT_S
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
        while len(ready) < self.config.pp_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(self.config.pp_size)) - ready)} not "
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
                self.last_heard = [time.monotonic()] * self.config.pp_size
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
        if await self._pull.poll(int(timeout_s * 1000)) == 0:
            return None
        msg = tp.decode(await self._pull.recv())
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


def served_name(model_path) -> str:
    """Name reported by /v1/models: the GGUF file name without extension and quantisation
    suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``), or the HF folder's
    name."""
    from pathlib import Path
    p = Path(model_path)
    if p.is_dir():
        return p.name
    stem = p.name[:-len(".gguf")] if p.name.endswith(".gguf") else p.stem
    head, _, tail = stem.rpartition(".")
    return head if head and (tail.upper().startswith(("Q", "F", "BF", "IQ"))) else stem


def _start_ignoring_sigint(proc: mp.Process) -> None:
    """Start ``proc`` with SIGINT ignored (inherited across exec): Ctrl-C reaches the engine,
    which shuts the workers down in order, instead of every worker raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        proc.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _worker_entry(args: WorkerArgs) -> None:
    from runtime.worker.main import run_worker
    run_worker(args)
