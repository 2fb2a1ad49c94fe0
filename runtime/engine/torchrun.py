"""Launching the pipeline with ``torchrun`` (one process per PP rank, possibly across machines).

Under torchrun every process gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and
``LOCAL_RANK``. The ``RANK`` 0 process runs the engine (and whatever entry point was launched:
server, generate) and spawns its own rank-0 worker as a local subprocess; it binds the engine's
zmq sockets on every interface: results PULL at ``tcp://*:{engine_port}``, the step PUSH of rank
``r`` at ``tcp://*:{engine_port + 1 + r}``. Every ``RANK`` > 0 process skips the engine and runs
:func:`runtime.worker.main.run_worker` itself, connected to ``tcp://MASTER_ADDR:{port}``; its layer
range comes from the same plan as the engine's (:func:`runtime.engine.plan.plan_pipeline`), so there
is no extra handshake. torch.distributed joins over ``env://``. The engine pings every rank each
:data:`HEARTBEAT_S` seconds; a worker that hears nothing for :data:`WORKER_IDLE_EXIT_S` seconds
assumes the engine is gone and exits. See docs/torchrun.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from runtime.config import EngineConfig

#: the variables torchrun sets for every process it launches
ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
#: seconds between the engine's pings to every rank
HEARTBEAT_S = 1.0
#: seconds without any engine message after which a torchrun worker exits
WORKER_IDLE_EXIT_S = 30.0


@dataclass(frozen=True)
class TorchrunEnv:
    """The torchrun variables of this process.

    Attributes:
        rank: global rank (``pp_rank * tp_size + tp_rank``; the PP rank without TP).
        world_size: number of processes (pipeline stages x TP ranks).
        master_addr: host of rank 0 (the engine binds its sockets there).
        master_port: torch.distributed rendezvous port (TCP).
        local_rank: rank on this machine (picks the GPU).
    """
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "TorchrunEnv | None":
        """Read the variables (default ``os.environ``); None unless all of :data:`ENV_VARS` are set.

        Raises:
            ValueError: a variable is set but is not an integer where one is expected.
        """
        env = os.environ if environ is None else environ
        if not all(k in env for k in ENV_VARS):
            return None
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]), int(env["LOCAL_RANK"]))
        except ValueError as exc:
            raise ValueError(f"--launcher: bad torchrun environment variable: {exc}") from None

    def engine_addr(self, port: int) -> str:
        """``tcp://MASTER_ADDR:port`` (IPv6 addresses in brackets)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{port}"


def resolve_cli(values: dict, environ: Mapping[str, str] | None = None) -> dict:
    """Resolve the launcher-related engine flags before :class:`EngineConfig` is built.

    ``launcher="auto"`` becomes ``torchrun`` when the torchrun variables are present, else
    ``spawn``; ``pp_size=None`` (``--pp`` not given) becomes ``WORLD_SIZE / tp_size`` under
    torchrun, else the EngineConfig default.

    Returns:
        a copy of ``values`` with ``launcher`` and ``pp_size`` filled in.

    Raises:
        ValueError: message starts with the offending flag: ``--launcher torchrun`` outside
            torchrun, or ``--pp`` x ``--tp`` different from ``WORLD_SIZE`` under torchrun.
    """
    out = dict(values)
    env = TorchrunEnv.from_environ(environ)
    if out.get("launcher", "auto") == "auto":
        out["launcher"] = "torchrun" if env is not None else "spawn"
    if out["launcher"] == "torchrun" and env is None:
        raise ValueError(f"--launcher: torchrun needs the variables {', '.join(ENV_VARS)}; start "
                         "with 'torchrun ... -m runtime.serve' or use --launcher spawn")
    tp_size = out.get("tp_size") or 1
    if out.get("pp_size") is None:
        out["pp_size"] = (env.world_size // tp_size if out["launcher"] == "torchrun"
                          else EngineConfig().scheduler.pp_size)
    if out["launcher"] == "torchrun" and out["pp_size"] * tp_size != env.world_size and tp_size == 1:
        raise ValueError(f"--pp: must equal torchrun's WORLD_SIZE={env.world_size} (one process per "
                         f"pipeline stage), got {out['pp_size']}; drop --pp to use WORLD_SIZE")
    if out["launcher"] == "torchrun" and out["pp_size"] * tp_size != env.world_size:
        raise ValueError(f"--pp: pp x tp must equal torchrun's WORLD_SIZE={env.world_size} (one "
                         f"process per rank of each stage), got {out['pp_size']} x {tp_size}; "
                         "drop --pp to use WORLD_SIZE / tp")
    return out


def remote_worker_args(config: EngineConfig, env: TorchrunEnv):
    """The :class:`~runtime.engine.plan.WorkerArgs` of a ``RANK`` > 0 process: layers from the
    local :func:`~runtime.engine.plan.plan_pipeline`, sockets on the engine's host, ``env://``
    rendezvous, idle exit.

    Raises:
        runtime.model.errors.ModelError: the model is not installed on this machine.
        ValueError: bad ``--pp-layer-partition``, or a configuration this machine cannot run.
    """
    from runtime.engine.plan import WorkerArgs, plan_pipeline  # loads torch: only on RANK > 0

    plan = plan_pipeline(config)
    return WorkerArgs(rank=env.rank, config=config.model_dump(),
                      layer_range=tuple(plan.layer_ranges[env.rank // config.tp_size]),
                      model_path=str(plan.model_path), init_method="env://",
                      step_addr=env.engine_addr(config.engine_port + 1 + env.rank),
                      result_addr=env.engine_addr(config.engine_port),
                      idle_exit_s=WORKER_IDLE_EXIT_S)


def run_remote_rank(config: EngineConfig, environ: Mapping[str, str] | None = None) -> int | None:
    """Entry points call this first: on a torchrun ``RANK`` > 0 process, serve as that rank's
    worker until the engine says shutdown (or goes silent) and return the exit status (0 clean,
    1 after an error, which is also reported to the engine). Returns None where this process
    should run the engine (spawn launcher, or ``RANK`` 0).
    """
    env = TorchrunEnv.from_environ(environ)
    if config.launcher != "torchrun" or env is None or env.rank == 0:
        return None
    from runtime.worker.main import report_error, run_worker
    try:
        args = remote_worker_args(config, env)
    except Exception as exc:  # noqa: BLE001 - e.g. model missing here: tell the engine, not a hang
        report_error(env.engine_addr(config.engine_port), env.rank, exc)
        return 1
    return run_worker(args)
