"""WorkerPool: spawns one worker process per PP rank on this machine and talks to them over zmq.

Engine -> rank r: a PUSH socket per rank (ipc) carrying step and control messages.
Ranks -> engine: one PULL socket (ipc) carrying ready, result and error messages.
All messages are msgspec/msgpack (:mod:`runtime.transport`); nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from ppstate.batch import SchedulerOutput, StepResult
from runtime import transport as tp
from runtime.config import EngineConfig
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
        self.model_name = served_name(self.model_path)
        n, pp = self.model_cfg.num_layers, config.pp_size
        self.layer_ranges = (parse_partition(config.pp_layer_partition, n, pp)
                             if config.pp_layer_partition else split_layers(n, pp, self.model_cfg))
        self.ctx = zmq.asyncio.Context()   # the result PULL socket (awaited)
        self.sync_ctx = zmq.Context()      # step PUSH sockets (never block: no high-water mark)
        self.procs: list[mp.Process] = []
        self._push: list[zmq.Socket] = []
        self._pull: zmq.asyncio.Socket | None = None
        self._shutdown_task: asyncio.Task | None = None

    async def start(self, ready_timeout_s: float = 600.0) -> None:
        """Spawn the ranks and wait until each reports ready.

        Raises:
            RuntimeError: a rank reported an error or died, or the timeout passed.
        """
        tag = f"{time.time_ns()}"
        result_addr = tp.ipc_address(f"res-{tag}")
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(result_addr)
        init = f"tcp://127.0.0.1:{free_port()}"
        spawn = mp.get_context("spawn")
        for rank, lr in enumerate(self.layer_ranges):
            addr = tp.ipc_address(f"step{rank}-{tag}")
            push = tp.make_push(self.sync_ctx, addr, bind=True, linger_ms=0)
            self._push.append(push)
            args = WorkerArgs(rank, self.config.model_dump(), tuple(lr), str(self.model_path),
                              init, addr, result_addr)
            proc = spawn.Process(target=_worker_entry, args=(args,), name=f"ppstate-rank{rank}",
                                 daemon=True)
            proc.start()
            self.procs.append(proc)
        await self._wait_ready(ready_timeout_s)

    async def _wait_ready(self, timeout_s: float) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks {sorted(set(range(len(self.procs))) - ready)} not "
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

    def send_step(self, out: SchedulerOutput) -> None:
        """Send one step to every rank (same bytes to all: the replicated decision input)."""
        data = tp.encode(tp.from_scheduler_output(out))
        for s in self._push:
            s.send(data, copy=False)

    def send_control(self, rank: int, msg) -> None:
        """Send a control message (e.g. a test's state corruption) to one rank."""
        self._push[rank].send(tp.encode(msg))

    async def recv(self, timeout_s: float):
        """Next message from any rank, or None after ``timeout_s`` seconds."""
        if await self._pull.poll(int(timeout_s * 1000)) == 0:
            return None
        return tp.decode(await self._pull.recv())

    @staticmethod
    def to_step_result(msg) -> StepResult:
        return tp.to_step_result(msg)

    def dead_ranks(self) -> list[int]:
        """Ranks whose process exited."""
        return [i for i, p in enumerate(self.procs) if not p.is_alive()]

    async def shutdown(self, grace_s: float = 5.0) -> None:
        """Ask every rank to stop, then terminate / kill stragglers, close every socket.
        Idempotent: a second caller waits for the first shutdown to finish."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(grace_s))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, grace_s: float) -> None:
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
                p.join(2)
            if p.is_alive():
                p.kill()
                p.join(2)
        self.ctx.destroy(linger=0)
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


def _worker_entry(args: WorkerArgs) -> None:
    from runtime.worker.main import run_worker
    run_worker(args)
