"""Test of the canonical form: is "same canonical key" a bisimulation on the reachable states?

:func:`check_bisimulation` explores the whole-state graph (``--no-canon``: worlds as they ran,
absolute steps, nothing forgotten) within small bounds, keys every state canonically
(:func:`~ppstate.check.canon.canonical_key` of a copy) and checks that any two states with one
canonical key have the same verdict (the invariants broken there, deadlock, end of run) and the
same set of canonical keys among their successors. If that holds for every reachable state, the
canonical keys partition the reachable graph into classes with one verdict and one future each
(a bisimulation), so exploring one representative per class misses no violation. The explorer
also runs the code on the *scrubbed* world (it continues from the canonical form), so each state's
scrubbed copy is expanded too and must give the same successors (canonical key and verdict of
each child). Together: the reduction is sound at those bounds, whatever the argument for each
rule says. Finally the explorer's own search (:func:`~ppstate.check.expand.expand` from the
canonical root, continuing from canonical forms) must reach exactly the canonical keys of the
reachable whole states: no class missed, and no state that is not the canonical form of a
reachable one (such a state would be a pickle of the same future that differs, e.g. in which
equal strings are one object, and would only inflate the count). ``tests/tools/test_check.py`` runs it.
"""

from __future__ import annotations

import zlib
from collections import deque

from ppstate import mutants
from ppstate.check.canon import canonical, canonical_key, scrub
from ppstate.check.choices import choice_vectors
from ppstate.check.expand import expand, step_world
from ppstate.check.judge import end_violations
from ppstate.check.snapshot import digest, dumps, loads
from ppstate.check.world import CheckConfig, World


def _verdict(w: World) -> tuple:
    found = w.violations or end_violations(w)
    return tuple(sorted({v["invariant"] for v in found}))


def check_bisimulation(cfg: CheckConfig, max_states: int = 20_000) -> dict:
    """Explore the whole-state graph of ``cfg``; returns ``{"states", "classes", "explored",
    "complete", "mismatches"}`` (mismatches: up to 5 descriptions of two states with one key and
    different verdicts or successor keys, or of keys the explorer reaches that no whole state has
    or misses; empty when the canonical keys form a bisimulation and the explorer finds exactly
    the classes)."""
    with mutants.enabled(*((cfg.mutant,) if cfg.mutant else ())):
        return _check(cfg, max_states)


def _successors(data: bytes) -> list[tuple[bytes, tuple]]:
    """``(child pickle, (child's canonical key, child's verdict))`` for every transition."""
    out = []
    for action in loads(data).actions():
        for _, child in choice_vectors(lambda ch: step_world(data, action, ch)):
            if child is not None:
                cdata = dumps(child)
                out.append((cdata, (canonical_key(loads(cdata)), _verdict(child))))
    return out


def _explored(cfg: CheckConfig) -> set:
    """Canonical keys the explorer reaches (violating states are not expanded)."""
    root = World(cfg)
    root.step_bound = False
    root.settle()
    data, key = canonical(loads(dumps(root)))
    seen, frontier = {key}, deque([zlib.compress(data, 1)])
    while frontier:
        for _, _, packed, child_key, found in expand(frontier.popleft(), True, seen):
            if child_key not in seen:
                seen.add(child_key)
                if not found:
                    frontier.append(packed)
    return seen


def _check(cfg: CheckConfig, max_states: int) -> dict:
    root = World(cfg)
    root.step_bound = False   # as in the explorer (the key includes it); a cycle hits max_states
    root.settle()
    data = dumps(root)
    seen = {digest(data)}
    frontier = deque([data])
    classes: dict[int, tuple] = {}   # canonical key -> (verdict, successor keys)
    mismatches: list[str] = []
    while frontier and len(seen) < max_states:
        data = frontier.popleft()
        w = loads(data)
        key = canonical_key(loads(data))
        verdict = _verdict(w)
        succ: set = set()
        if not verdict:
            for cdata, child_key in _successors(data):
                succ.add(child_key)
                d = digest(cdata)
                if d not in seen:
                    seen.add(d)
                    frontier.append(cdata)
            sw = loads(data)
            scrub(sw)
            from_scrubbed = {k for _, k in _successors(dumps(sw))}
            if from_scrubbed != succ and len(mismatches) < 5:
                mismatches.append(f"key {key:016x}: the scrubbed world's successors differ "
                                  f"({len(from_scrubbed ^ succ)} keys)")
        got = (verdict, frozenset(succ))
        want = classes.setdefault(key, got)
        if want != got and len(mismatches) < 5:
            mismatches.append(f"key {key:016x}: verdict {want[0]} vs {got[0]}, "
                              f"{len(want[1] ^ got[1])} successor keys differ")
    explored = _explored(cfg) if not frontier else set()
    for what, keys in (("reached by the explorer only", explored - set(classes)),
                       ("missed by the explorer", set(classes) - explored if explored else ())):
        if keys and len(mismatches) < 5:
            mismatches.append(f"{len(keys)} canonical keys {what}")
    return {"states": len(seen), "classes": len(classes), "explored": len(explored),
            "complete": not frontier, "mismatches": mismatches}
