"""Engines started for one test, stopped for certain when it ends (:class:`EngineFactory`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from runtime.config import EngineConfig
from runtime.engine import AsyncEngine
from runtime.engine.rank_process import process_state


class EngineFactory:
    """``await factory(pp_size=2, model="default", **engine_config_fields) -> AsyncEngine``.

    Every engine records a trace (``docs/trace_format.md``) in a fresh run directory under
    ``trace_base``, so ``assert_invariants(engine)`` can replay it; ``on_trace(run_dir)`` is
    called with each run directory (the plugin prints them when the test fails).

    Args:
        trace_base: parent of the engines' run directories.
        on_trace: callback receiving each run directory (``str``).
    """

    def __init__(self, trace_base: Path, on_trace: Callable[[str], None]) -> None:
        self.trace_base, self.on_trace = Path(trace_base), on_trace
        self.engines: list[AsyncEngine] = []
        self.pids: list[int] = []

    async def __call__(self, pp_size: int = 2, model: str = "default", **fields) -> AsyncEngine:
        """Start an engine of ``pp_size`` worker processes on ``model``.

        ``fields`` are further :class:`EngineConfig` fields (``max_model_len``,
        ``max_prefill_chunk``, ``mode``, ...; the scheduler fields given flat); ``device`` defaults to ``cpu``.

        Raises:
            pydantic.ValidationError: a bad field; runtime.engine.EngineDeadError: a worker
            failed while starting (its processes are already stopped then).
        """
        fields.setdefault("device", "cpu")
        fields.setdefault("trace_dir", str(self.trace_base))
        config = EngineConfig(model=model, pp_size=pp_size, **fields)
        engine = await AsyncEngine.start(config)
        self.engines.append(engine)
        self.pids += [p.pid for p in engine.pool.procs if p.pid is not None]
        if engine.config.trace_dir:
            self.on_trace(engine.config.trace_dir)
        return engine

    async def close(self) -> list[str]:
        """Shut every engine down (also after a failure); kill any worker process still alive.
        Returns a message per engine whose shutdown raised (the processes are gone anyway)."""
        errors = []
        for engine in reversed(self.engines):
            try:
                await engine.shutdown()
            except BaseException as exc:  # noqa: BLE001 - teardown must reach every process
                errors.append(f"shutdown of {engine.config.trace_dir}: {exc!r}")
            for p in engine.pool.procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        self.engines.clear()
        return errors


def alive_pids(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        state = process_state(pid)
        if state is None and _exists(pid) or state not in (None, "Z"):
            out.append(pid)
    return out


def _exists(pid: int) -> bool:
    if os.path.isdir("/proc"):
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
