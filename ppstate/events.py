"""One event sink for every decision and state change (lifecycle edge, scheduler output, PPHandler
enqueue / consume / free, broadcast posted / skipped, sampled ids).

Callers guard emission with ``if sink.enabled:`` so a disabled sink costs one attribute read.
A file sink writes each event as one flat JSON object (``{"kind", "step", "rank", ...fields}``);
the typed pydantic models of every kind, the run header and the reader live in
:mod:`ppstate.trace` (format: ``docs/trace_format.md``).
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO, Callable

import msgspec
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
    """Base sink: disabled, drops everything.

    Attributes:
        enabled: emit sites run only when True (``if sink.enabled:``).
        trace_prompts: record prompt token ids (``--trace-prompts``); otherwise only lengths.
    """
    enabled: bool = False
    trace_prompts: bool = False

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        """Record one event (no-op here)."""

    def emit_when(self, ready: Callable[[], bool], kind: str, step: int, rank: int | None,
                  fields: Callable[[], dict[str, Any]]) -> None:
        """Record an event whose fields are known only once ``ready()`` (e.g. a device-to-host
        copy landed); it keeps its place in the order. Here: ``fields()`` now (may block)."""
        self.emit(kind, step, rank, **fields())

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


class RecordingSink(EventSink):
    """Keeps each event as the flat dict a :class:`JsonlSink` writes (replay, the simulator)."""
    enabled = True

    def __init__(self, trace_prompts: bool = False) -> None:
        self.trace_prompts = trace_prompts
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        self.events.append({"kind": kind, "step": step, "rank": rank, **data})


class JsonlSink(EventSink):
    """Writes one flat JSON object per event to a new file (``--trace-dir``).

    Args:
        path: the file; it must not exist (a run never appends to another run's trace).
        trace_prompts: record prompt token ids, not only prompt lengths.

    Raises:
        FileExistsError: ``path`` exists.
    """
    enabled = True

    def __init__(self, path: str | Path, trace_prompts: bool = False) -> None:
        self.path = Path(path)
        self.trace_prompts = trace_prompts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: BinaryIO = self.path.open("xb", buffering=1 << 16)
        # msgspec's encoder: the same compact JSON as json.dumps(separators=(",", ":")) (UTF-8
        # instead of \u escapes), 5-10x faster on the schedule and tokens events of a big step
        self._encode = msgspec.json.Encoder().encode

        # events held behind a deferred one (emit_when) whose fields are not ready yet:
        # encoded lines (bytes) and (ready, kind, step, rank, fields) entries, in emit order
        self._held: deque = deque()

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        line = self._encode({"kind": kind, "step": step, "rank": rank, **data})
        if self._held:
            self._held.append(line)
            self._drain()
        else:
            self._fh.write(line)
            self._fh.write(b"\n")

    def emit_when(self, ready: Callable[[], bool], kind: str, step: int, rank: int | None,
                  fields: Callable[[], dict[str, Any]]) -> None:
        """Hold the event (and every later one) until ``ready()``; written at a later emit that
        finds it ready, or at :meth:`flush` / :meth:`close`, which wait up to
        :attr:`HOLD_TIMEOUT_S` for it. So a rank records the sampled ids without waiting for the
        device in the step (docs/trace_format.md: the file order is the emit order)."""
        self._held.append((ready, kind, step, rank, fields))
        self._drain()

    #: seconds flush / close wait for a held event (a device stuck behind a hung collective never
    #: completes the step: its event and the later ones are then dropped, the trace ends before it)
    HOLD_TIMEOUT_S = 5.0

    def _drain(self, wait_s: float = 0.0) -> None:
        held, fh = self._held, self._fh
        deadline = time.monotonic() + wait_s
        while held:
            head = held[0]
            if type(head) is not bytes:
                ready, kind, step, rank, fields = head
                while not ready():
                    if time.monotonic() >= deadline:
                        if wait_s:
                            held.clear()
                        return
                    time.sleep(0.001)
                head = self._encode({"kind": kind, "step": step, "rank": rank, **fields()})
            fh.write(head)
            fh.write(b"\n")
            held.popleft()

    def flush(self) -> None:
        """Write the held events (waiting for them, :attr:`HOLD_TIMEOUT_S`) and push buffered
        ones to the file."""
        self._drain(self.HOLD_TIMEOUT_S)
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._drain(self.HOLD_TIMEOUT_S)
            self._fh.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read back a :class:`JsonlSink` file as flat dicts; a truncated last line (a killed
    process) is dropped. Typed parsing: :func:`ppstate.trace.models.parse_event`."""
    out = []
    with Path(path).open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise
    return out
