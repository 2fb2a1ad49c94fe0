"""Event comparison and the divergence record of a replay.

Events are compared as the flat dicts the sinks write, after a JSON round trip (tuples become
lists), so every field counts, also fields added after this file was written. :data:`ANY` in an
expected event matches any recorded value (used where the recording lacks the input that would
determine a field, e.g. the ids of a step whose result never reached the engine).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

CONTEXT_EVENTS = 6  # recorded events shown before a divergence


class _Any:
    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()


def normalise(event: dict[str, Any]) -> dict[str, Any]:
    """``event`` as it reads back from a JSON line (keeps :data:`ANY` markers)."""
    text = json.dumps(event, default=lambda o: "__ANY__" if o is ANY else str(o))
    return json.loads(text, object_hook=lambda d: {k: (ANY if v == "__ANY__" else v)
                                                    for k, v in d.items()})


def matches(expected: Any, recorded: Any) -> bool:
    """Structural equality where :data:`ANY` in ``expected`` matches anything."""
    if expected is ANY:
        return True
    if isinstance(expected, dict):
        return isinstance(recorded, dict) and expected.keys() == recorded.keys() and \
            all(matches(v, recorded[k]) for k, v in expected.items())
    if isinstance(expected, list):
        return isinstance(recorded, list) and len(expected) == len(recorded) and \
            all(matches(a, b) for a, b in zip(expected, recorded))
    return expected == recorded


@dataclass
class Divergence:
    """First point where the replay disagrees with the recording.

    Attributes:
        step: the step it belongs to.
        rank: PP rank whose stream diverged (None: the engine / scheduler).
        kind: kind of the replayed event (or of the recorded one when replay produced nothing).
        recorded: the recorded event (None: the recording lacks an event replay produced).
        replayed: what replay produced there (None: nothing; ``{"error": ...}``: replay raised).
        context: the recorded events of the same stream just before it, oldest first.
    """
    step: int
    rank: int | None
    kind: str
    recorded: dict | None
    replayed: dict | None
    context: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["replayed"] = _printable(d["replayed"])
        return d

    def sort_key(self) -> tuple[int, int]:
        return (self.step, -1 if self.rank is None else self.rank)


def _printable(value: Any) -> Any:
    if value is ANY:
        return "*"
    if isinstance(value, dict):
        return {k: _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def context_before(events: list[dict], index: int) -> list[dict]:
    """Up to :data:`CONTEXT_EVENTS` events of ``events`` before ``index``."""
    return events[max(0, index - CONTEXT_EVENTS):index]
