"""One event sink for every decision and state change (lifecycle edge, scheduler output, PPHandler
enqueue / consume / free, broadcast posted / skipped, sampled ids).

Callers guard emission with ``if sink.enabled:`` so a disabled sink costs one attribute read.
Events are pydantic models so a recorded run can be written as JSON lines and read back for replay.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, Field


class Event(BaseModel):
    """One recorded fact.

    Attributes:
        kind: what happened, e.g. ``lifecycle``, ``schedule``, ``pp.enqueue``, ``pp.consume``,
            ``pp.free``, ``broadcast.posted``, ``broadcast.skipped``, ``sampled``.
        step: scheduler step the event belongs to (-1 when none).
        rank: PP rank that emitted it (None for the engine / scheduler).
        data: kind-specific fields (JSON-serialisable).
    """
    kind: str
    step: int = -1
    rank: int | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class EventSink:
    """Base sink: disabled, drops everything."""
    enabled: bool = False

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        """Record one event (no-op here)."""

    def close(self) -> None:
        """Flush and release resources."""


NULL_SINK = EventSink()


class ListSink(EventSink):
    """Keeps events in memory (tests, the simulator, the model checker)."""
    enabled = True

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        self.events.append(Event(kind=kind, step=step, rank=rank, data=data))

    def of_kind(self, kind: str) -> list[Event]:
        """Events whose kind equals ``kind``."""
        return [e for e in self.events if e.kind == kind]


class JsonlSink(EventSink):
    """Appends one JSON object per event to a file (``--trace-dir``)."""
    enabled = True

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = self.path.open("a", encoding="utf-8")

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        self._fh.write(Event(kind=kind, step=step, rank=rank, data=data).model_dump_json() + "\n")

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> list[Event]:
    """Read back a :class:`JsonlSink` file."""
    with Path(path).open(encoding="utf-8") as fh:
        return [Event.model_validate(json.loads(line)) for line in fh if line.strip()]
