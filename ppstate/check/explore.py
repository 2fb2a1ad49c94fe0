"""Breadth-first explicit-state exploration of :class:`~ppstate.check.world.World`.

Each frontier state is stored as its pickle; two states are the same when their keys are equal
(:mod:`ppstate.check.canon`: each child is rewritten into its canonical form, with history that
cannot influence the future forgotten and names renumbered, and exploration continues from that
form; the key is a 64-bit fingerprint of its pickle. ``canon=False``: the world is kept as it
ran and keyed by a digest of its whole pickle). States are expanded by
:mod:`ppstate.check.expand`, with ``jobs`` > 1 a BFS level at a time by worker processes, and
deduplicated here in frontier order. Breadth first, so the first violation found has a shortest
path (the canonical form is a bisimulation, which keeps distances: docs/checker_canon.md): its
actions (with the choices taken inside each) are kept as parent links and replayed into a trace
by :mod:`ppstate.check.counterexample`.

Judged in every state: the monitor's invariants (:mod:`ppstate.check.monitor`); deadlock (work
left and nothing can move: no rank step, result or issue, which settling already tried); at the
end of a run (every request arrived and none live) no op may be left unmatched. After the last
level, with canonical keys: no cycle of engine moves (a livelock; :mod:`ppstate.check.cycles`).
Without them the absolute step bound of :class:`~ppstate.check.world.World` stands in.
"""

from __future__ import annotations

import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from ppstate import mutants
from ppstate.check.canon import canonical
from ppstate.check.cycles import EdgeLog
from ppstate.check.choices import Chooser
from ppstate.check.expand import Parents, children_cpu_seconds, levels, peak_rss_mb
from ppstate.check.judge import end_violations
from ppstate.check.snapshot import digest, dumps, loads
from ppstate.check.world import CheckConfig, World


@dataclass
class CheckResult:
    """Outcome of one exploration (the CLI's JSON object, with ``counterexample`` added)."""
    config: dict
    states: int = 0
    transitions: int = 0
    depth: int = 0
    complete: bool = True
    seconds: float = 0.0       # wall
    cpu_seconds: float = 0.0   # CPU of this process and of its --jobs workers
    peak_rss_mb: float = 0.0   # peak resident memory of this process (MiB)
    peak_worker_rss_mb: float = 0.0   # of the largest --jobs worker (MiB; 0 with jobs 1)
    violations: list[dict] = field(default_factory=list)
    path: list[tuple] = field(default_factory=list)   # (action, choices) of the first violation
    counterexample: str | None = None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["path"] = [[list(a), list(c)] for a, c in self.path]
        d["num_violations"] = len(self.violations)
        return d


def explore(cfg: CheckConfig, max_states: int = 2_000_000, max_violations: int = 1,
            canon: bool = True, jobs: int = 1, progress: TextIO | None = None) -> CheckResult:
    """Explore every state reachable within ``cfg``'s bounds (see the module docstring).

    Args:
        cfg: bounds, mode, mutant.
        max_states: stop (``complete`` False) after this many distinct states.
        max_violations: stop after this many violating states (each is not expanded).
        canon: key states by :func:`~ppstate.check.canon.canonical_key` (False: by the digest
            of the whole pickle, as before; for comparisons).
        jobs: worker processes expanding each BFS level (1: in this process). The parent
            deduplicates in BFS order, so states, transitions, depth and the first violation's
            path are those of ``jobs=1``.
        progress: where a line per BFS level goes (depth, states, transitions, seconds).
    """
    names = (cfg.mutant,) if cfg.mutant else ()
    with mutants.enabled(*names):
        return _explore(cfg, max_states, max_violations, canon, jobs, progress)


def _explore(cfg: CheckConfig, max_states: int, max_violations: int,
             canon: bool, jobs: int, progress: TextIO | None) -> CheckResult:
    t0 = (time.perf_counter(), time.process_time() + children_cpu_seconds())
    res = CheckResult(config=cfg.as_dict())
    root = World(cfg)
    root.step_bound = not canon
    root.settle()
    root = loads(dumps(root))   # as every other state: restored from a pickle (snapshot.py)
    data, key = canonical(root) if canon else (dumps(root), digest(dumps(root)))
    seen: dict = {key: 0}
    edges = EdgeLog() if canon else None
    parents = Parents()
    frontier: deque[tuple[int, int, bytes]] = deque([(0, 0, zlib.compress(data, 1))])
    res.states, next_id = 1, 1
    level = 0
    for (nid, depth, _), succ in levels(frontier, canon, jobs, seen):
        if progress is not None and depth != level:
            level = depth
            print(f"pp={cfg.pp_size} level={depth} states={res.states} "
                  f"transitions={res.transitions} "
                  f"seconds={time.perf_counter() - t0[0]:.1f}", file=progress, flush=True)
        for action, choices, cdata, d, found in succ:
            res.transitions += 1
            cid = seen.get(d)
            if cid is None:
                cid, next_id = next_id, next_id + 1
                seen[d] = cid
                parents.add(cid, nid, action, choices)
                res.states += 1
                res.depth = max(res.depth, depth + 1)
                if found:
                    if not res.violations:
                        res.path = parents.path(cid)
                    res.violations += found
                    if len({v["message"] for v in res.violations}) >= max_violations:
                        return _finish(res, cfg, t0)
                    continue
                if cdata is None:   # expand.py: the pickle comes with the first sighting
                    raise RuntimeError(f"state {d:x} is new but came without its pickle")
                frontier.append((cid, depth + 1, cdata))
            if edges is not None and action[0] in EdgeLog.ENGINE_MOVES:
                edges.add(nid, cid, action, choices)
            if res.states >= max_states:
                res.complete = False
                return _finish(res, cfg, t0)
    if edges is not None and not res.violations:
        cycle = edges.find_cycle()
        if cycle is not None:
            res.path = parents.path(cycle[0]) + cycle[1]
            res.violations = [{"invariant": 6, "step": None, "rank": None,
                               "message": f"no progress: a cycle of {len(cycle[1])} engine moves "
                                          f"(results, issues, rank steps) returns to the same "
                                          f"state without any request progressing"}]
    res = _finish(res, cfg, t0)
    if progress is not None:
        print(f"pp={cfg.pp_size} done states={res.states} transitions={res.transitions} "
              f"depth={res.depth} seconds={res.seconds} cpu_seconds={res.cpu_seconds}",
              file=progress, flush=True)
    return res


def _finish(res: CheckResult, cfg: CheckConfig, t0: tuple[float, float]) -> CheckResult:
    """Report the first violation with the absolute step numbers of a replay of its path (the
    explored state's steps are relative)."""
    if res.violations and res.violations[0]["step"] is not None:
        w = replay_path(cfg, res.path)
        real = w.violations or end_violations(w)
        if real:
            res.violations = real
    res.seconds = round(time.perf_counter() - t0[0], 3)
    res.cpu_seconds = round(time.process_time() + children_cpu_seconds() - t0[1], 3)
    res.peak_rss_mb, res.peak_worker_rss_mb = peak_rss_mb()
    return res


def replay_path(cfg: CheckConfig, path: list[tuple], record: bool = True,
                drain: bool = False) -> World:
    """Re-run ``path`` (actions with their choices) from the initial state; ``drain``: then run
    on to the end (:meth:`World.drain`)."""
    names = (cfg.mutant,) if cfg.mutant else ()
    with mutants.enabled(*names):
        w = World(cfg, record=record)
        w.settle()
        for action, choices in path:
            if not w.apply(tuple(action), Chooser(tuple(choices))):
                raise RuntimeError(f"path action {action} not enabled on replay")
        if drain:
            w.drain()
        return w
