"""Argument types of ``python -m runtime.bench.spec`` (its own flags; the engine flags come from
:mod:`runtime.cli_common`). Each raises :class:`argparse.ArgumentTypeError`, so a bad value exits
with status 2 and ``error: argument --FLAG: ...`` before any engine starts (they were tracebacks
with exit 1 from inside the run, or ran a workload or ``K`` that was not asked for)."""

from __future__ import annotations

import argparse
import math

from ppstate.sim.cli_args import number, positive
from ppstate.speculative import MAX_SPEC_TOKENS

#: the workloads of :func:`runtime.bench.spec.prompts`
WORKLOADS = ("friendly", "unfriendly", "mixed")


#: an integer >= 1 (``--num-requests``, ``--concurrency``, ``--max-tokens``, ``--repeats``)
positive_int = positive


def temperature(text: str) -> float:
    """A finite float >= 0 (``--temperature``; 0: greedy)."""
    value = number(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def spec_list(text: str) -> list[int]:
    """``--spec-list``: comma-separated ``K`` values, each in [1, MAX_SPEC_TOKENS] (0 is the
    off engine, always run), without repeats."""
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not all(1 <= k <= MAX_SPEC_TOKENS for k in ks) or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(
            f"each K must be in [1, {MAX_SPEC_TOKENS}] and given once (off is always run), "
            f"got {text!r}")
    return ks


def workloads(text: str) -> list[str]:
    """``--workloads``: comma-separated names of :data:`WORKLOADS`, without repeats."""
    names = text.split(",")
    bad = [w for w in names if w not in WORKLOADS]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated names of {', '.join(WORKLOADS)} (each once), got {text!r}")
    return names
