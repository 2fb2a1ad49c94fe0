"""Nondeterministic choices inside one transition (EOS or not per sampled row, rejected tokens).

A transition that meets choice points is run once per complete choice vector: :class:`Chooser`
replays a forced prefix and takes option 0 beyond it while recording how many options each point
had; :func:`choice_vectors` walks that tree depth first. A recorded vector replays the same
transition exactly (counterexample traces).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Chooser:
    """Answers ``choose(n)`` from ``forced`` first, then 0; records every (choice, n)."""

    def __init__(self, forced: tuple[int, ...] = ()) -> None:
        self.forced = forced
        self.taken: list[int] = []
        self.options: list[int] = []

    def choose(self, n: int) -> int:
        """An index in ``range(n)`` (``n >= 1``)."""
        k = len(self.taken)
        c = self.forced[k] if k < len(self.forced) else 0
        if not 0 <= c < n:
            raise ValueError(f"forced choice {c} at point {k} out of range({n})")
        self.taken.append(c)
        self.options.append(n)
        return c


def choice_vectors(run: Callable[[Chooser], T]) -> Iterator[tuple[tuple[int, ...], T]]:
    """Every complete choice vector of ``run`` with its outcome, depth first.

    ``run(chooser)`` must be deterministic given the chooser's answers (it is called once per
    vector, on a fresh copy of the state).
    """
    stack: list[tuple[int, ...]] = [()]
    while stack:
        prefix = stack.pop()
        ch = Chooser(prefix)
        outcome = run(ch)
        yield tuple(ch.taken), outcome
        for k in range(len(ch.taken) - 1, len(prefix) - 1, -1):
            for alt in range(ch.options[k] - 1, 0, -1):
                stack.append(tuple(ch.taken[:k]) + (alt,))
