"""Per-rank timelines of a recorded run from its ``timing`` events (monotonic nanoseconds).

:func:`chrome_trace` builds Chrome / Perfetto trace-event JSON (one track per rank; complete
``"X"`` events for forward, sample, send, recv, broadcast, and ``idle`` for the gaps);
:func:`plot_gantt` draws a Gantt chart of stage occupancy with matplotlib (imported lazily).
Trace-event format: "Trace Event Format" (Google, catapult project), complete events ``ph: "X"``
with ``ts`` / ``dur`` in microseconds, metadata events ``ph: "M"``.

Bubble fraction = 1 - (time ranks spent computing, i.e. forward + sample) / (pp_size x active
time), where active time is the union of every recorded phase of every rank: a rank idle while work
exists (``docs/design.md`` §2), without counting the time a server had nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppstate.trace.run import TraceRun

COMPUTE_PHASES = ("forward", "sample")
COLOURS = {"forward": "#4c72b0", "sample": "#8172b2", "send": "#55a868", "recv": "#dd8452",
           "broadcast": "#c44e52", "idle": "#dddddd"}


@dataclass(frozen=True)
class Slice:
    """One phase of one step on one rank (nanoseconds on the shared monotonic clock)."""
    rank: int
    step: int
    phase: str
    t0_ns: int
    t1_ns: int


def slices(run: TraceRun) -> list[Slice]:
    """Every ``timing`` event of every rank, sorted by rank then start."""
    out = [Slice(r, e["step"], e["phase"], e["t0_ns"], e["t1_ns"])
           for r, events in run.ranks.items() for e in events if e.get("kind") == "timing"]
    return sorted(out, key=lambda s: (s.rank, s.t0_ns))


def active_ns(sl: list[Slice]) -> int:
    """Length of the union of all slices (ns): time during which some rank had work."""
    total, end = 0, None
    for s in sorted(sl, key=lambda s: s.t0_ns):
        if end is None or s.t0_ns > end:
            total += s.t1_ns - s.t0_ns
            end = s.t1_ns
        elif s.t1_ns > end:
            total += s.t1_ns - end
            end = s.t1_ns
    return total


def bubble_fraction(sl: list[Slice], pp_size: int) -> float:
    """1 - compute time / (pp_size x active time); 0.0 without timings."""
    active = active_ns(sl)
    busy = sum(s.t1_ns - s.t0_ns for s in sl if s.phase in COMPUTE_PHASES)
    return max(0.0, 1.0 - busy / (pp_size * active)) if active > 0 else 0.0


def chrome_trace(run: TraceRun) -> dict:
    """The run's timeline as a trace-event JSON object (``{"traceEvents": [...]}``).

    Every event has ``name``, ``ph``, ``ts`` (µs from the first phase), ``pid`` (0) and ``tid``
    (the rank); complete events add ``dur`` (µs) and ``args.step``.
    """
    sl = slices(run)
    origin = min((s.t0_ns for s in sl), default=0)
    events: list[dict] = [{"name": "process_name", "ph": "M", "ts": 0, "pid": 0, "tid": 0,
                           "args": {"name": f"ppstate run {run.header.run_id}"}}]
    for r in range(run.header.pp_size):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": r,
                       "args": {"name": f"rank {r}"}})
    last_end: dict[int, int] = {}
    for s in sl:
        prev = last_end.get(s.rank)
        if prev is not None and s.t0_ns > prev:
            events.append(_complete("idle", s.rank, s.step, prev, s.t0_ns, origin))
        events.append(_complete(s.phase, s.rank, s.step, s.t0_ns, s.t1_ns, origin))
        last_end[s.rank] = max(prev or 0, s.t1_ns)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_id": run.header.run_id,
                          "bubble_fraction": bubble_fraction(sl, run.header.pp_size)}}


def _complete(name: str, rank: int, step: int, t0: int, t1: int, origin: int) -> dict:
    return {"name": name, "ph": "X", "ts": (t0 - origin) / 1e3, "dur": (t1 - t0) / 1e3,
            "pid": 0, "tid": rank, "args": {"step": step}}


def plot_gantt(run: TraceRun, path: str | Path) -> float:
    """Write a PNG Gantt chart of stage occupancy (one lane per rank); returns the bubble fraction.

    Raises:
        RuntimeError: matplotlib is not installed (names the pip command).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'ppstate[plot]' "
                           "(or pip install matplotlib)") from exc
    sl = slices(run)
    pp = run.header.pp_size
    bubble = bubble_fraction(sl, pp)
    origin = min((s.t0_ns for s in sl), default=0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * pp))
    for phase, colour in COLOURS.items():
        for r in range(pp):
            bars = [((s.t0_ns - origin) / 1e6, (s.t1_ns - s.t0_ns) / 1e6)
                    for s in sl if s.rank == r and s.phase == phase]
            if bars:
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=colour)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title(f"stage occupancy, run {run.header.run_id}: bubble fraction {bubble:.3f}")
    ax.legend(handles=[Patch(color=c, label=p) for p, c in COLOURS.items() if p != "idle"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return bubble
