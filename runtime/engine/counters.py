"""The engine's run counters behind ``AsyncEngine.stats()`` and /metrics.

Steps and tokens delivered, each rank's busy seconds (the ``busy_s`` its result messages carry:
seconds computing, not waiting on peers), and the seconds with at least one step in flight. The
bubble fraction is derived from them: ``1 - sum(rank busy seconds) / (pp_size x active
seconds)``, the share of rank-time with work in the pipeline that no rank spent computing
(0 = no bubble; the glossary's "bubble": a rank idle while work exists).
"""

from __future__ import annotations

import time


class EngineCounters:
    """Counters of one engine's life (one pipeline of ``pp_size`` ranks).

    Attributes:
        steps_total: step results delivered. tokens_total: output tokens delivered.
        busy_s: ``[pp_size]`` seconds each rank computed.
        dropped_rows: ``[pp_size]`` deferred rows each rank's PPHandler dropped as stale
            (rows of a slot freed or preempted since the step; 0 on the last rank).
    """

    def __init__(self, pp_size: int) -> None:
        self.pp_size = pp_size
        self.steps_total = 0
        self.tokens_total = 0
        self.busy_s = [0.0] * pp_size            # [pp_size] seconds
        self.dropped_rows = [0] * pp_size        # [pp_size] rows
        self._active_s = 0.0                     # seconds with a step in flight, closed spans
        self._active_since: float | None = None  # monotonic start of the open span, if any

    def note_dropped(self, rank: int, total: int) -> None:
        """Rank ``rank`` reports its cumulative dropped-row count (results may be reordered
        across ranks, never within one: the count only grows)."""
        self.dropped_rows[rank] = max(self.dropped_rows[rank], total)

    def step_issued(self) -> None:
        """A step went out: opens an active span if none is open."""
        if self._active_since is None:
            self._active_since = time.monotonic()

    def pipeline_idle(self) -> None:
        """No step is in flight any more: closes the open active span."""
        if self._active_since is not None:
            self._active_s += time.monotonic() - self._active_since
            self._active_since = None

    def active_seconds(self) -> float:
        """Seconds with at least one step in flight, the open span included."""
        open_s = 0.0 if self._active_since is None else time.monotonic() - self._active_since
        return self._active_s + open_s

    def snapshot(self) -> dict:
        """``steps_total``, ``generated_tokens_total``, ``rank_busy_seconds``,
        ``bubble_fraction``, ``pp_size``, ``active_seconds`` (module doc) and
        ``dropped_deferred_rows`` (per rank)."""
        active = self.active_seconds()
        bubble = max(0.0, 1.0 - sum(self.busy_s) / (self.pp_size * active)) if active > 0 else 0.0
        return {"steps_total": self.steps_total, "generated_tokens_total": self.tokens_total,
                "rank_busy_seconds": list(self.busy_s), "bubble_fraction": bubble,
                "pp_size": self.pp_size, "active_seconds": active,
                "dropped_deferred_rows": list(self.dropped_rows)}
