"""``assert_invariants(x)``: fail a test with the first broken invariant, named and located.

``x`` may be a trace (a run directory or a ``--trace-dir`` holding runs, a loaded
:class:`~ppstate.trace.run.TraceRun`, a :class:`~ppstate.replay.replayer.ReplayResult`), a
:class:`~ppstate.testing.sim_pipeline.SimPipeline`, a list of violation dicts, or a live engine
(any object with ``config.trace_dir`` naming its run directory and a ``sink`` with ``flush()``,
e.g. ``runtime.engine.AsyncEngine`` started with a trace directory). Traces and engines are
replayed (:func:`ppstate.replay.replayer.replay`), which re-derives every scheduler and rank
decision and checks the invariants of ``specs/invariants.md`` on what was recorded.

Pure: no torch, no asyncio (the engine is only duck-typed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppstate.oracle.invariants import INVARIANT_NAMES, describe  # noqa: F401 (re-exported)
from ppstate.replay.replayer import ReplayResult, replay as _replay
from ppstate.replay.explain import explain as _explain
from ppstate.trace.run import TraceRun, load_run


class InvariantViolation(AssertionError):
    """An invariant was broken. ``violation`` is the first one: ``{invariant, step, rank,
    message}``; ``violations`` all that were found; ``source`` what was checked."""

    def __init__(self, violations: list[dict], source: str, divergence: dict | None = None) -> None:
        violations = sorted(violations, key=lambda v: v["step"])  # stable: first by step
        self.violations = violations
        self.violation = violations[0] if violations else None
        self.divergence = divergence
        self.source = source
        super().__init__(format_failure(violations, source, divergence))


def format_failure(violations: list[dict], source: str, divergence: dict | None) -> str:
    """The message of :class:`InvariantViolation`: the first violation first, then the rest."""
    lines = [f"{source}:"]
    if violations:
        lines.append("  " + describe(violations[0]))
        lines += ["  also " + describe(v) for v in violations[1:6]]
        if len(violations) > 6:
            lines.append(f"  ... {len(violations) - 6} more")
    if divergence is not None:
        lines.append(f"  replay diverged from the recording at step {divergence['step']} rank "
                     f"{divergence['rank']} ({divergence['kind']}): recorded "
                     f"{divergence['recorded']} replayed {divergence['replayed']}")
    return "\n".join(lines)


def replay(trace_dir: str | Path | TraceRun, until: int | None = None) -> ReplayResult:
    """Replay a recorded run (``docs/trace_format.md``) and return its
    :class:`~ppstate.replay.replayer.ReplayResult` (``ok``, ``steps``, ``first_divergence``,
    ``invariant_violations``, ...); ``result.assert_ok()`` raises on any finding.

    Raises:
        ppstate.trace.run.TraceError: ``trace_dir`` holds no readable run.
    """
    return _replay(trace_dir, until=until)


def explain(trace_dir: str | Path | TraceRun, req_id: str) -> list[dict[str, Any]]:
    """One request's life in a recorded run, in order: ``{step, rank, what, ...}`` entries
    (``arrival``, ``admitted``, ``scheduled`` with ``start`` / ``num_scheduled_tokens`` /
    ``final_chunk``,
    ``lifecycle``, ``tokens``, ``deferred consume``, ``slot freed``); see
    :func:`ppstate.replay.explain.explain`.

    Raises:
        ppstate.trace.run.TraceError: ``trace_dir`` holds no readable run.
    """
    run = trace_dir if isinstance(trace_dir, TraceRun) else load_run(trace_dir)
    return _explain(run, req_id)


def _engine_run_dir(engine: Any) -> Path:
    trace_dir = getattr(getattr(engine, "config", None), "trace_dir", None)
    if not trace_dir:
        raise TypeError("assert_invariants(engine): the engine records no trace; start it with "
                        "a trace_dir (the pp_engine fixture always does)")
    try:  # the scheduler's events so far; ranks' files hold what they flushed (all, once shut down)
        engine.sink.flush()
    except ValueError:  # already closed by shutdown: the file is complete
        pass
    return Path(trace_dir)


def assert_invariants(target: Any, *, divergence_fails: bool = True) -> ReplayResult | None:
    """Raise :class:`InvariantViolation` naming the first broken invariant and its step (for a
    trace: replay's own findings and the violations its writer recorded that replay cannot
    re-derive, e.g. a simulator trace's rank-side ones).

    Args:
        target: see the module docstring.
        divergence_fails: for replayed traces, also fail when a recorded decision differs from
            the one the current scheduler re-derives (a bug or a trace of another version).

    Returns:
        the :class:`ReplayResult` when ``target`` was replayed, else None.

    Raises:
        InvariantViolation: a violation (or a divergence, see above).
        TypeError: ``target`` is none of the accepted kinds.
    """
    from ppstate.testing.sim_pipeline import SimPipeline
    if isinstance(target, SimPipeline):
        found = target.violations()
        if found:
            raise InvariantViolation(found, f"simulated pipeline (seed {target.config.seed})")
        return None
    if isinstance(target, list):
        if target:
            raise InvariantViolation(target, "violations")
        return None
    if isinstance(target, ReplayResult):
        res = target
    elif isinstance(target, (str, Path, TraceRun)):
        res = replay(target)
    elif hasattr(target, "sink") and hasattr(target, "config"):
        res = replay(_engine_run_dir(target))
    else:
        raise TypeError(f"assert_invariants: cannot check a {type(target).__name__}")
    div = res.first_divergence if divergence_fails else None
    found = res.invariant_violations + [  # and what the simulator recorded, not found again
        {k: v for k, v in rec.items() if k != "refound"} for rec in res.unrefound]
    if found or div is not None:
        raise InvariantViolation(found, f"replay of {res.run_dir}", div)
    return res
