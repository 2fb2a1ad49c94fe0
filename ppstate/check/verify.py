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
rule says. ``tests/test_check.py`` runs it.
"""

from __future__ import annotations

from collections import deque

from ppstate import mutants
from ppstate.check.canon import canonical_key, scrub
from ppstate.check.choices import choice_vectors
from ppstate.check.expand import step_world
from ppstate.check.judge import end_violations
from ppstate.check.snapshot import digest, dumps, loads
from ppstate.check.world import CheckConfig, World


def _verdict(w: World) -> tuple:
    found = w.violations or end_violations(w)
    return tuple(sorted({v["invariant"] for v in found}))


def check_bisimulation(cfg: CheckConfig, max_states: int = 20_000) -> dict:
    """Explore the whole-state graph of ``cfg``; returns ``{"states", "classes", "mismatches"}``
    (mismatches: up to 5 descriptions of two states with one key and different verdicts or
    successor keys; empty when the canonical keys form a bisimulation)."""
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


def _check(cfg: CheckConfig, max_states: int) -> dict:
    root = World(cfg)
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
    return {"states": len(seen), "classes": len(classes), "complete": not frontier,
            "mismatches": mismatches}
