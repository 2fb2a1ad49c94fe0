"""``python -m ppstate.replay DIR [--json] [--until STEP] [--explain REQ_ID] [--timeline OUT.json]
[--plot OUT.png]``: replay a recorded run without the model or any GPU.

DIR is a run directory (``header.json`` + ``engine.jsonl`` + ``rank<N>.jsonl``) or a
``--trace-dir`` holding several: the newest run is replayed. Prints ``ok``, ``steps``, ``events``,
``first_divergence`` and ``invariant_violations`` (one JSON object with ``--json``); exits 0 when
ok, 1 on a divergence or a violation, 2 when DIR holds no readable run, a run replay cannot
re-derive (a speculative run recorded without ``--trace-prompts``) or a flag is bad (an
``--explain`` id that is not in the run: the error lists the run's request ids).

Library use: :func:`replay` (``ppstate.replay.replayer``) returns a :class:`ReplayResult`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ppstate.oracle.invariants import describe
from ppstate.replay.replayer import ReplayFailure, ReplayResult, replay
from ppstate.trace.run import TraceError, load_run

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ppstate.replay",
                                description="Replay a recorded ppstate run and check it")
    p.add_argument("dir", help="run directory, or a --trace-dir (its newest run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--until", type=int, default=None, metavar="STEP",
                   help="replay up to STEP and print the state there")
    p.add_argument("--explain", default=None, metavar="REQ_ID", help="print one request's life")
    p.add_argument("--timeline", default=None, metavar="OUT.json",
                   help="write a Chrome / Perfetto trace-event file (one track per rank)")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write a Gantt chart of stage occupancy (needs matplotlib)")
    return p


def _dumps(obj) -> str:
    """JSON text of ``obj``; a replayed event may hold the ``ANY`` marker of
    :mod:`ppstate.replay.compare` (a field replay cannot know), written as ``"ANY"``."""
    return json.dumps(obj, default=str)


def state_heading(until: int, last_step: int | None, recorded_steps: list[int]) -> str:
    """The words in front of the state printed by ``--until``.

    ``until`` replays the events stamped with steps ``<= until`` (an input carries the number of
    the step the scheduler issues next), so the state shown is the one at ``until`` even when
    that number was not issued (a skipped number changes nothing); the heading says which:
    ``last_step`` is the last step replay re-derived up to there (None: none),
    ``recorded_steps`` the run's recorded step numbers in order.
    """
    upto = [s for s in recorded_steps if s <= until]
    if upto and upto[-1] != last_step:
        return (f"state where replay stopped at a divergence, after step {last_step} (the run "
                f"recorded steps up to {upto[-1]} by --until {until})")
    if last_step == until:
        return f"state after step {until}"
    if last_step is None:
        return f"state before any step: none was issued up to step {until}"
    if until > recorded_steps[-1]:
        return f"state at the end of the run: --until {until} is past its last step, {last_step}"
    return (f"state at step {until}, a skipped number (no step {until} was issued: it would have "
            f"carried no row); the last step issued before it: {last_step}")


def _summary(res: ReplayResult, until: int | None = None,
             recorded_steps: list[int] | None = None) -> str:
    lines = [f"run {res.run_id} ({res.source}) at {res.run_dir}",
             f"ok={res.ok} steps={res.steps} events={res.events} rank_steps={res.rank_steps}",
             f"checked: {res.checked}"]
    if res.first_divergence:
        d = res.first_divergence
        lines.append(f"first divergence: step {d['step']} rank {d['rank']} kind {d['kind']}")
        lines.append(f"  recorded: {_dumps(d['recorded'])}")
        lines.append(f"  replayed: {_dumps(d['replayed'])}")
        lines += [f"  before:   {_dumps(c)}" for c in d["context"]]
    lines += [describe(v) for v in res.invariant_violations]   # found by replay itself
    lines += _recorded(res)
    if res.state is not None and until is not None:
        heading = state_heading(until, res.state["last_step"], recorded_steps or [])
        lines.append(f"{heading}: {json.dumps(res.state)}")
    return "\n".join(lines)


#: the writer of a run, by the header's ``source``
WRITERS = {"sim": "simulator", "check": "model checker", "engine": "engine"}


def _recorded(res: ReplayResult) -> list[str]:
    """Text lines of the violations the run's writer recorded (none when it records none)."""
    rec = res.recorded_violations
    if not rec:
        return []
    total = max(res.num_recorded_violations or 0, len(rec))
    writer = WRITERS.get(res.source, res.source)
    lines = [f"recorded by the {writer}: {total} invariant violations"
             + (f" (the first {len(rec)} kept)" if total > len(rec) else "")
             + f", {sum(v['refound'] for v in rec)} of them also found by replay:"]
    lines += [f"  {'re-found' if v['refound'] else 'recorded'}: {describe(v)}" for v in rec]
    if res.repro:
        lines.append(f"re-run the {writer} (its ranks) with: {res.repro}")
    return lines


#: request ids listed at most in the error of an unknown ``--explain`` id
LISTED_IDS = 20


def _check_explain(p: argparse.ArgumentParser, run, req_id: str) -> None:
    """Exit 2 (``p.error``) naming ``--explain`` and the run's request ids (the first
    :data:`LISTED_IDS`) when ``req_id`` never arrived in ``run``."""
    from ppstate.replay.explain import request_ids
    ids = request_ids(run)
    if req_id in ids:
        return
    shown = ", ".join(ids[:LISTED_IDS]) + (f", ... ({len(ids)} in all)" if len(ids) > LISTED_IDS else "")
    p.error(f"--explain: request {req_id!r} is not in this run; its requests: {shown or 'none'}")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.until is not None and ns.until < 0:
        p.error("--until: must be >= 0")
    for flag, path in (("--timeline", ns.timeline), ("--plot", ns.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path is not None else None
        if folder is not None and not os.path.isdir(folder):
            p.error(f"{flag}: the folder {folder} of {path} does not exist")
    try:
        run = load_run(ns.dir)
        if ns.explain is not None:
            _check_explain(p, run, ns.explain)
        res = replay(run, until=ns.until)
    except (TraceError, OSError) as exc:   # also UnreplayableTrace: refused before comparing
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = res.as_dict()
    if ns.explain is not None:
        from ppstate.replay.explain import explain, format_life
        life = explain(run, ns.explain)
        out["explain"] = life
        if not ns.json:
            print(format_life(ns.explain, life))
    if ns.timeline is not None:
        from ppstate.replay.timeline import chrome_trace
        with open(ns.timeline, "w", encoding="utf-8") as fh:
            json.dump(chrome_trace(run), fh)
        out["timeline"] = ns.timeline
    if ns.plot is not None:
        from ppstate.replay.timeline import plot_gantt
        try:
            out["bubble_fraction"] = plot_gantt(run, ns.plot)
        except RuntimeError as exc:
            print(f"error: --plot: {exc}", file=sys.stderr)
            return 2
        out["plot"] = ns.plot
    steps = [e["step"] for e in run.engine if e.get("kind") == "schedule"]
    print(_dumps(out) if ns.json else _summary(res, ns.until, steps))
    return 0 if res.ok else 1
