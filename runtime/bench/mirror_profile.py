"""Where a rank's mirror validation spends its host time, call by call (``python -m runtime.bench
mirror --profile``), and its device time per step.

:func:`profile_modes` runs ``steps`` steps of the model-free loop (:class:`~runtime.bench.mirror.
RankLoop`) under :mod:`cProfile` in each mode (off, on, before) and reports, per function, the
calls and the own time (``tottime``) per step; :func:`call_diff` subtracts off's from a mode's,
so what the validation adds shows function by function (the profiler's own overhead inflates
Python-level calls more than C calls: shares, not absolute figures). :func:`graph_gpu_us` times
the check's CUDA graph alone on the device (CUDA events around back-to-back replays);
:func:`replay_host_us` the host time of one ``replay()`` call of that graph and of small graphs
holding one kind of node each, to tell what the launch's host time scales with.
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


def _capture(fn) -> "torch.cuda.CUDAGraph":
    """``fn``'s work captured as a CUDA graph (warmed up once outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _host_us(g, calls: int, repeats: int = 5) -> float:
    """Least host microseconds per ``g.replay()`` over ``repeats`` runs of ``calls`` replays (the
    device drained between runs, so a launch never waits for queue space)."""
    import time
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            g.replay()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return 1e6 * best


def replay_host_us(check, calls: int = 50) -> dict | None:
    """Host microseconds per ``replay()``: ``check``'s graph of buffer 0 (``check_graph``) and
    graphs of one node kind each over buffers of the check's sizes: one small kernel
    (``one_kernel``), twenty (``twenty_kernels``), one kernel and a 1-byte copy to pinned host
    memory (``kernel_d2h_pinned``), one kernel and the expected values' copy from pinned host
    memory (``kernel_h2d_pinned``). None without CUDA or graphs."""
    dev = getattr(check, "dev", None)
    if dev is None or not dev.graphs or not torch.cuda.is_available():
        return None
    x = torch.zeros(dev.n, dtype=torch.int64, device="cuda")
    flag_h = torch.zeros(1, dtype=torch.bool, pin_memory=True)
    exp_h, exp_d = dev.exp_host[0], dev.exp_dev[0]
    graphs = {"one_kernel": _capture(lambda: x.add_(1)),
              "twenty_kernels": _capture(lambda: [x.add_(1) for _ in range(20)]),
              "kernel_d2h_pinned": _capture(lambda: (x.add_(1),
                                                     flag_h.copy_(x[:1] > 0, non_blocking=True))),
              "kernel_h2d_pinned": _capture(lambda: (exp_d.copy_(exp_h, non_blocking=True),
                                                     x.add_(1)))}
    out = {"check_graph": _host_us(dev.graphs[0], calls)}
    out.update({k: _host_us(g, calls) for k, g in graphs.items()})
    return {k: round(v, 2) for k, v in out.items()}
