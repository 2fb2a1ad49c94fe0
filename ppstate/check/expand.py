"""Expanding frontier states, in this process or in ``--jobs`` worker processes, and the compact
parent links the explorer keeps for counterexample paths.

:func:`expand` runs every action (and every choice vector inside it) of one pickled state on a
fresh copy, judges each child and rewrites it into its canonical form. The child's pickle is only
compressed and returned when the child may be new: in this process the explorer passes its set of
seen keys; a worker process remembers every key it returned a pickle for (``_RETURNED``) and
returns only the key for those again. That is exact: the explorer consumes the workers' results in
the order the frontier entries were handed out (``Pool.imap``), and a worker takes its entries in
that order too, so the entry that carried the pickle was consumed first.

:func:`levels` yields ``(frontier entry, successors)`` in BFS order; with ``jobs`` > 1 a level at
a time is expanded by a pool of forked worker processes, so the parent only deduplicates (about
10 microseconds per successor against about 2 milliseconds to compute one).
"""

from __future__ import annotations

import multiprocessing
import resource
import zlib
from array import array
from collections import deque
from collections.abc import Container, Iterator

from ppstate.check.canon import canonical
from ppstate.check.choices import Chooser, choice_vectors
from ppstate.check.cycles import move_code
from ppstate.check.judge import end_violations
from ppstate.check.snapshot import digest, dumps, loads
from ppstate.check.world import World

_RETURNED: set = set()   # in a worker process: keys whose pickle it returned


def step_world(data: bytes, action: tuple, chooser: Chooser, w: World | None = None) -> World | None:
    """Apply ``action`` with ``chooser``'s answers to the state pickled in ``data`` (or to ``w``,
    a fresh copy of it); None when the action changed nothing."""
    w = loads(data) if w is None else w
    return w if w.apply(action, chooser) else None


def expand(packed: bytes, canon: bool, known: Container | None = None) -> list[tuple]:
    """Every successor of one compressed pickled state: ``(action, choices, compressed pickle or
    None, key, violations)``; the pickle is None when ``known`` (None: this worker's returned
    keys) already holds the key."""
    data = zlib.decompress(packed)
    w: World | None = loads(data)
    worker = known is None
    known = _RETURNED if worker else known
    succ = []
    for action in w.actions():
        def run(ch: Chooser, action=action):
            nonlocal w
            fresh, w = w, None        # the copy that listed the actions serves the first run
            return step_world(data, action, ch, fresh)
        for choices, child in choice_vectors(run):
            if child is None:
                continue
            found = child.violations or end_violations(child)
            if canon:
                cdata, key = canonical(child)
            else:
                cdata = dumps(child)
                key = digest(cdata)
            if key in known:
                packed_child = None
            else:
                packed_child = zlib.compress(cdata, 1)
                if worker:
                    _RETURNED.add(key)
            succ.append((action, choices, packed_child, key, found))
    return succ


def _expand_in_worker(item: tuple[bytes, bool]) -> list[tuple]:
    return expand(item[0], item[1])


def levels(frontier: deque, canon: bool, jobs: int, seen: Container) -> Iterator[tuple]:
    """(frontier entry, its successors) in BFS order (module docstring); entries are
    ``(state id, depth, compressed pickle)`` and the caller appends the next level to
    ``frontier`` while iterating."""
    if jobs <= 1:
        while frontier:
            entry = frontier.popleft()
            yield entry, expand(entry[2], canon, seen)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        while frontier:
            level = list(frontier)
            frontier.clear()
            size = max(1, min(64, len(level) // (8 * jobs)))
            work = ((e[2], canon) for e in level)
            for entry, succ in zip(level, pool.imap(_expand_in_worker, work, chunksize=size)):
                yield entry, succ


def children_cpu_seconds() -> float:
    """CPU seconds of the worker processes that ended (user + system)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def peak_rss_mb() -> tuple[float, float]:
    """Peak resident memory in MiB of this process and of the largest ended worker (Linux
    reports ``ru_maxrss`` in KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return round(own / 1024, 1), round(workers / 1024, 1)


class Parents:
    """Parent link of every state but the root: the parent's id and the move (action, choices)
    that led here, as two arrays (12 bytes a state) and a table of the distinct moves."""

    def __init__(self) -> None:
        self.parent = array("q", [-1])   # state id -> parent id (the root has none)
        self.move = array("i", [-1])     # state id -> index into _moves
        self._codes: dict[tuple, int] = {}
        self._moves: list[tuple] = []

    def add(self, nid: int, parent: int, action: tuple, choices: tuple) -> None:
        """Record state ``nid`` (the next id: ids are handed out in order)."""
        assert nid == len(self.parent), (nid, len(self.parent))
        self.parent.append(parent)
        self.move.append(move_code(self._codes, self._moves, action, choices))

    def path(self, nid: int) -> list[tuple]:
        """The moves from the root to state ``nid``."""
        out = []
        while self.parent[nid] >= 0:
            out.append(self._moves[self.move[nid]])
            nid = self.parent[nid]
        return out[::-1]
