"""Argument types of the simulator's command lines (``python -m ppstate.sim``, ``.soak``).

Each type refuses a value out of its range with :class:`argparse.ArgumentTypeError`, so argparse
exits 2 with ``argument --FLAG: must be ..., got VALUE``: the message names the flag and its
range, where a value left to :class:`ppstate.sim.workload.SimConfig` was refused naming the
dataclass field (or run: a negative ``--shared-prefix`` ran as 0). NaN and infinity are out of
every range.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from ppstate.speculative import MAX_SPEC_TOKENS


def integer(text: str) -> int:
    """An integer (ArgumentTypeError naming the text otherwise)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def number(text: str) -> float:
    """A float (ArgumentTypeError naming the text otherwise; NaN and infinity pass)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def at_least(low: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (``why`` is added to the message)."""
    def parse(text: str) -> int:
        value = integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{why}, got {value}")
        return value
    return parse


positive = at_least(1)
non_negative = at_least(0)


def probability(text: str) -> float:
    """A probability: a float in [0, 1]."""
    value = number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value:g}")
    return value


def slow_down(text: str) -> float:
    """``--contention``: a finite float >= 1 (infinity ended in an OverflowError traceback)."""
    value = number(text)
    if not value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be >= 1 (a slow-down: 1 = none), got {value:g}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {value:g}")
    return value


def spec_tokens(text: str) -> int:
    """``--spec-tokens``: an integer in [0, MAX_SPEC_TOKENS], the engine's own bound."""
    value = integer(text)
    if not 0 <= value <= MAX_SPEC_TOKENS:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SPEC_TOKENS}] (the engine's "
                                         f"--spec-tokens bound), got {value}")
    return value


def _pair(text: str) -> tuple[int, int]:
    """``A:B`` with two integers."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B with integers, got {text!r}") from None
    return lo, hi


def length_range(text: str) -> tuple[int, int]:
    """``--prompt-len`` / ``--output-len``: ``A:B`` tokens with 1 <= A <= B (inclusive)."""
    lo, hi = _pair(text)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"must be A:B with 1 <= A <= B, got {lo}:{hi}")
    return lo, hi


def stage_cost(text: str) -> tuple[int, int]:
    """``--stage-cost``: ``BASE:PER_TOKEN`` ticks, both >= 0 and not both 0."""
    base, per_token = _pair(text)
    if base < 0 or per_token < 0 or base + per_token == 0:
        raise argparse.ArgumentTypeError(f"must be BASE:PER_TOKEN with both >= 0, not both 0, "
                                         f"got {base}:{per_token}")
    return base, per_token
