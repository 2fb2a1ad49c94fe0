"""Where a rank's mirror validation spends its host time, call by call (``python -m runtime.bench
mirror --profile``), and its device time per step.

:func:`profile_modes` runs ``steps`` steps of the model-free loop (:class:`~runtime.bench.mirror.
RankLoop`) under :mod:`cProfile` in each mode (off, on, before) and reports, per function, the
calls and the own time (``tottime``) per step; :func:`call_diff` subtracts off's from a mode's,
so what the validation adds shows function by function (the profiler's own overhead inflates
Python-level calls more than C calls: shares, not absolute figures). :func:`graph_gpu_us` times
the check's CUDA graph alone on the device (CUDA events around back-to-back replays).
"""

from __future__ import annotations

import cProfile
import pstats

import torch


def _label(func: tuple) -> str:
    """``file:line(name)`` of a pstats key, the file shortened to its last two parts."""
    path, line, name = func
    if path == "~":
        return name
    return f"{'/'.join(path.split('/')[-2:])}:{line}({name})"


def profile_mode(loop, steps: int, mode) -> dict[str, tuple[float, float]]:
    """``{function: (calls per step, own microseconds per step)}`` of ``steps`` steps in
    ``mode`` (after one unprofiled block of the same length)."""
    loop.block(steps, mode)
    prof = cProfile.Profile()
    prof.enable()
    loop.block(steps, mode)
    prof.disable()
    stats = pstats.Stats(prof).stats   # func -> (cc, nc, tt, ct, callers)
    return {_label(f): (v[1] / steps, 1e6 * v[2] / steps) for f, v in stats.items()}


def call_diff(on: dict, off: dict, top: int = 25, min_us: float = 0.5) -> list[dict]:
    """The ``top`` functions whose own time per step grows most from ``off`` to ``on`` (by at
    least ``min_us``): ``{"call", "calls_per_step", "us_per_step", "added_us"}``, largest first."""
    rows = []
    for name, (calls, us) in on.items():
        added = us - off.get(name, (0.0, 0.0))[1]
        if added >= min_us:
            rows.append({"call": name, "calls_per_step": round(calls, 2),
                         "us_per_step": round(us, 2), "added_us": round(added, 2)})
    rows.sort(key=lambda r: -r["added_us"])
    return rows[:top]


def profile_modes(loop, steps: int, modes=(False, True, "before"), top: int = 25) -> dict:
    """Per mode beyond off: the total own time per step and :func:`call_diff` against off."""
    prof = {str(m): profile_mode(loop, steps, m) for m in modes}
    off = prof[str(modes[0])]
    out = {"off_total_us": round(sum(us for _, us in off.values()), 1)}
    for m in modes[1:]:
        on = prof[str(m)]
        out[str(m)] = {"total_us": round(sum(us for _, us in on.values()), 1),
                       "added": call_diff(on, off, top)}
    return out


def graph_gpu_us(check, replays: int = 200) -> float | None:
    """Device microseconds per replay of ``check``'s CUDA graph of buffer 0 (an
    :class:`~runtime.worker.mirror_check.AsyncMirrorCheck`, now or as of an older revision,
    whose graphs are captured), back to
    back between two events; None without CUDA or graphs. Nothing is compared: the flags it
    writes are stale (call when no snapshot is pending)."""
    dev = getattr(check, "dev", None)
    graphs = dev.graphs if dev is not None else getattr(check, "_graphs", None)   # older: own
    if not graphs or not torch.cuda.is_available():
        return None
    g = graphs[0]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / replays
