"""``replay(path)``: rebuild the core from a recorded run's inputs, re-derive every decision,
compare it with the recording and check the invariants (pure: no torch, no asyncio, no model).

Used by ``python -m ppstate.replay`` and meant as a library call (a model checker's
counterexamples, a pytest plugin): ``result = replay(trace_dir); result.assert_ok()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppstate.batch import SchedulerOutput
from ppstate.replay.checks import TraceOracle
from ppstate.codec import decode_output
from ppstate.replay.compare import Divergence
from ppstate.replay.engine import EngineReplay
from ppstate.replay.rank import RankReplay, RankSetup
from ppstate.trace.run import TraceError, TraceRun, load_run


class ReplayFailure(AssertionError):
    """A replay found a divergence or an invariant violation (raised by ``assert_ok``)."""


class UnreplayableTrace(TraceError):
    """A readable run that replay cannot re-derive: it lacks inputs the recorded scheduler read
    (the CLI's exit status 2, before any comparison)."""


def refusal(run: TraceRun) -> str | None:
    """Why replay cannot re-derive ``run``, or None.

    A speculative run (``num_spec_tokens`` K > 0) with the scheduler's n-gram probe on
    (``spec_probe_ngram`` n > 0) decides each decode row's drafts from the request's prompt ids
    (:mod:`ppstate.speculative_probe`); arrivals recorded without them (no ``--trace-prompts``)
    would give the replay scheduler stand-in prompts, other drafts and a false ``schedule``
    divergence. Read from the header's ``scheduler`` and the arrivals, so traces written before
    this check are judged the same way.
    """
    k = run.header.scheduler.get("num_spec_tokens", 0)
    n = run.header.scheduler.get("spec_probe_ngram", 0)
    if not (k and n):
        return None
    arrivals = [e for e in run.engine if e.get("kind") == "arrival"]
    missing = sum(e.get("prompt_token_ids") is None for e in arrivals)
    if not missing:
        return None
    return (f"{run.path}: cannot replay: recorded with --spec-tokens {k} and the n-gram probe on "
            f"(--spec-probe-ngram {n}) but without --trace-prompts; the probe decides each "
            f"step's drafts from the prompt token ids, which {missing} of the {len(arrivals)} "
            f"arrivals lack, so replay would report a false divergence. Re-record with "
            f"--trace-dir DIR --trace-prompts (or with --spec-probe-ngram 0)")


@dataclass
class ReplayResult:
    """Outcome of one replay (the CLI's JSON object).

    Attributes:
        ok: no divergence, no invariant violation, and none recorded by the run's writer.
        steps: steps the scheduler replay re-derived (recorded ``schedule`` events matched).
        events: events read (all files of the run).
        first_divergence: the earliest divergence by (step, engine before ranks), or None.
        invariant_violations: ``{invariant, step, rank, message}`` per violation (plus
            ``slot`` / ``req_id`` where the check knows them).
        run_dir: the run directory replayed; run_id, source: from its header.
        rank_steps: steps compared per rank file present.
        state: with ``until``: scheduler and PPHandler state after the events of steps
            ``<= until``; ``last_step`` is the last step issued up to there (None: none), less
            than ``until`` when that number was skipped or is past the run's end.
        checked: what replay re-derived and compared, in words (the scheduler; each rank file
            present, or why there is none).
        recorded_violations: the violations the run's writer found itself (the simulator,
            whose ranks are not in the trace; header ``recorded_violations``, up to ``until``),
            each with ``refound``: whether replay's own checks found the same (invariant, step,
            rank). None when the header records none (engine traces, older traces).
        num_recorded_violations: the writer's count of them in all (it keeps the first ones).
        repro: the header's command that re-runs the writer (the simulated ranks), or None.
    """
    ok: bool
    steps: int
    events: int
    first_divergence: dict | None
    invariant_violations: list[dict]
    run_dir: str = ""
    run_id: str = ""
    source: str = ""
    rank_steps: dict[int, int] = field(default_factory=dict)
    state: dict[str, Any] | None = None
    checked: str = ""
    recorded_violations: list[dict] | None = None
    num_recorded_violations: int | None = None
    repro: str | None = None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rank_steps"] = {str(k): v for k, v in self.rank_steps.items()}
        for key in ("state", "recorded_violations", "num_recorded_violations", "repro"):
            if d[key] is None:
                del d[key]
        return d

    @property
    def unrefound(self) -> list[dict]:
        """Recorded violations that replay's own checks did not find again."""
        return [v for v in self.recorded_violations or [] if not v["refound"]]

    def assert_invariants(self) -> None:
        """Raise :class:`ReplayFailure` when an invariant was violated, found by replay or
        recorded by the run's writer (divergences ignored: e.g. a trace recorded by an older
        version of the scheduler)."""
        found = self.invariant_violations + self.unrefound   # + what the writer recorded
        if found:
            raise ReplayFailure(f"replay of {self.run_dir}: " + "; ".join(
                f"invariant {v['invariant']} at step {v['step']} rank {v['rank']}: {v['message']}"
                for v in found[:10]))

    def assert_ok(self) -> None:
        """Raise :class:`ReplayFailure` describing the first divergence / violations."""
        if self.ok:
            return
        parts = []
        if self.first_divergence:
            d = self.first_divergence
            parts.append(f"first divergence at step {d['step']} rank {d['rank']} ({d['kind']}): "
                         f"recorded {d['recorded']} replayed {d['replayed']}")
        parts += [f"invariant {v['invariant']} at step {v['step']} rank {v['rank']}: {v['message']}"
                  for v in self.invariant_violations[:10]]
        parts += [f"recorded by the {self.source}: invariant {v['invariant']} at step {v['step']} "
                  f"rank {v['rank']}: {v['message']}" for v in self.unrefound[:10]]
        raise ReplayFailure(f"replay of {self.run_dir} failed:\n  " + "\n  ".join(parts))


def validate_every_of(run: TraceRun) -> int:
    """Mirror validation period of a recorded engine run (0: off)."""
    v = str(run.header.config.get("validate_mirrors", "every"))
    return 0 if v == "off" else 1 if v == "every" else int(v)


def replay(path: str | Path | TraceRun, until: int | None = None) -> ReplayResult:
    """Replay the run at ``path`` (a run directory, or a trace dir: its newest run).

    Args:
        path: directory (or an already loaded :class:`TraceRun`).
        until: compare only events of steps ``<= until``; the result then carries ``state``.

    Raises:
        ppstate.trace.run.TraceError: the directory holds no readable run.
        UnreplayableTrace: a run replay cannot re-derive (:func:`refusal` says why).
    """
    run = path if isinstance(path, TraceRun) else load_run(path)
    if (why := refusal(run)) is not None:
        raise UnreplayableTrace(why)
    outputs: dict[int, SchedulerOutput] = {}
    results: dict[int, dict] = {}
    for ev in run.engine:
        if ev.get("kind") == "schedule":
            outputs[ev["step"]] = decode_output(ev["output"])
        elif ev.get("kind") == "result":
            results[ev["of_step"]] = ev
    engine = EngineReplay(run, until)
    checker = TraceOracle(engine.sched, run.header.pp_size)
    engine.on_event = lambda ev, _s: checker.on_engine_event(ev)
    divergences: list[Divergence] = []
    if (d := engine.replay()) is not None:
        divergences.append(d)
        checker.detach_scheduler()
        _check_rest(run, engine, checker, d, until)
    elif until is None and run.header.source != "engine":
        checker.finish(engine.sched, engine.sched.next_step)
    cfg = run.scheduler_config
    rank_steps, handlers = {}, {}
    for rank, events in sorted(run.ranks.items()):
        rr = RankReplay(RankSetup(rank, cfg.pp_size, cfg.mode, cfg.max_num_seqs,
                                  validate_every_of(run)), outputs, results, checker)
        d, rank_steps[rank] = rr.compare(events, until)
        if d is not None:
            divergences.append(d)
        for ev in events:
            if until is None or ev.get("step", -1) <= until:
                checker.on_rank_event(ev)
        handlers[rank] = rr.handler
    first = min(divergences, key=Divergence.sort_key) if divergences else None
    violations = checker.violations
    recorded = recorded_violations(run, violations, until)
    return ReplayResult(
        ok=first is None and not violations and not recorded, steps=engine.steps,
        events=run.num_events, first_divergence=first.as_dict() if first else None,
        invariant_violations=violations, run_dir=str(run.path), run_id=run.header.run_id,
        source=run.header.source, rank_steps=rank_steps,
        state=_state(engine, handlers) if until is not None else None, checked=checked(run),
        recorded_violations=recorded, num_recorded_violations=run.header.num_recorded_violations,
        repro=run.header.repro)


def checked(run: TraceRun) -> str:
    """What replay re-derives and compares for ``run``, in words."""
    ranks = sorted(run.ranks)
    if ranks:
        return (f"scheduler decisions (engine.jsonl) and ranks {', '.join(map(str, ranks))} "
                f"(rank<N>.jsonl) of {run.header.pp_size}")
    why = ("the simulated ranks are not recorded; the violations the simulator found are "
           "listed as recorded" if run.header.source == "sim" else "no rank<N>.jsonl here")
    return f"scheduler decisions (engine.jsonl) only: {why}"


def recorded_violations(run: TraceRun, found: list[dict], until: int | None) -> list[dict] | None:
    """The header's ``recorded_violations`` up to ``until``, each with ``refound``: whether
    ``found`` (replay's own) holds the same (invariant, step, rank). None when not recorded."""
    if run.header.recorded_violations is None:
        return None
    mine = {(v["invariant"], v["step"], v["rank"]) for v in found}
    return [{**v, "refound": (v["invariant"], v["step"], v["rank"]) in mine}
            for v in run.header.recorded_violations if until is None or v["step"] <= until]


def _check_rest(run: TraceRun, engine: EngineReplay, checker: TraceOracle, d: Divergence,
                until: int | None) -> None:
    """After a divergence: keep checking invariants on the rest of the recording."""
    seen = False
    for ev in engine.recorded:
        if ev is d.recorded:
            seen = True
        if seen and (until is None or ev.get("step", -1) <= until):
            checker.on_engine_event(ev)


def _state(engine: EngineReplay, handlers: dict) -> dict[str, Any]:
    s = engine.sched
    running = {r.req_id: {"state": r.state, "slot": r.slot,
                          "num_computed_tokens": int(s.arrays.num_computed_tokens[r.slot]),
                          "num_output_tokens": int(s.arrays.num_output_tokens[r.slot])}
               for r in s.running_requests()}
    return {"last_step": engine.last_step, "next_step": s.next_step, "in_flight": s.in_flight, "num_waiting": s.num_waiting,
            "running": running, "slot_generation": s.slots.generation.tolist(),
            "pp_pending_steps": {str(r): h.pending_steps() for r, h in handlers.items()
                                 if h is not None}}
