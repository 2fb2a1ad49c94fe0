"""Counterexamples as traces (format version 1, ``docs/trace_format.md``).

The explorer keeps the shortest path to a violation as actions with the choices taken inside
them. :func:`write_counterexample` re-runs that path with every event recorded and writes a run
directory (source ``check``), after running the path on to its end without further choices
(:meth:`~ppstate.check.world.World.drain`: a blocked step completes, a deadlock stays one): ``engine.jsonl`` from the real scheduler's event sink and one
``rank<N>.jsonl`` per rank, in the runtime worker's event order, so ``python -m ppstate.replay``
re-derives the run and reports the violation from the recording alone.
"""

from __future__ import annotations

from pathlib import Path

from ppstate.check.explore import replay_path
from ppstate.check.world import CheckConfig
from ppstate.trace.run import write_run


def write_counterexample(cfg: CheckConfig, path: list[tuple], base: str | Path) -> Path:
    """Write the run of ``path`` under ``base`` (a new ``run-*`` directory); returns it.

    Raises:
        RuntimeError: the path does not replay (the explorer and the replay disagree).
    """
    w = replay_path(cfg, path, record=True, drain=True)
    config = {**cfg.as_dict(), "validate_mirrors": "every",
              "path": [[list(a), list(c)] for a, c in path]}
    return write_run(base, "check", cfg.scheduler_config(), config, list(w.sched_sink.events),
                     {rk.rank: list(rk.sink.events) for rk in w.ranks})
