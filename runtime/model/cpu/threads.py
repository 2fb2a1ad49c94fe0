"""How the ranks of one pipeline share the machine's cores on the CPU fast path.

The stages of a pipeline run at the same time (overlapped schedule). By default every rank may use
every core: ONNX Runtime's helper threads sleep while their rank waits (spinning off,
``runtime.model.cpu.sessions``), so a stage waiting in a bubble leaves all cores to the other one,
and when both compute the OS shares the cores between them. Served on the 2-core machine at 8
streams this gave PP=2 0.79x and 0.85x of PP=1, against 0.72x and 0.61x with the threads split
evenly (one per rank) in the same runs (docs/cpu_fast_path.md). ``--cpu-threads N`` splits N
threads evenly between the stages instead; ``--cpu-pin`` pins each rank to its own share of the
cores (off by default: on the shared machine a pinned rank could not move off a core busy with
other jobs, and PP=2 served 1.3-3x slower pinned).
"""

from __future__ import annotations

import os

import torch


def plan_threads(total: int | None, pp_size: int, rank: int, cpus: list[int] | None = None,
                 pin: bool = False) -> tuple[int, list[int] | None]:
    """Threads and cores of ``rank``.

    Args:
        total: threads for the whole pipeline, split evenly between the stages (None: every rank
            gets every core this process may use, unless ``pin``).
        pp_size: stages; rank: this stage's rank.
        cpus: the cores this process may use (default: ``os.sched_getaffinity(0)``).
        pin: give each rank its own cores (then ``total`` defaults to all of ``cpus``).
    Returns:
        ``(threads, cores)``: ``len(cpus)`` threads and no cores when neither ``total`` nor ``pin``
        is given; else ``max(1, total // pp_size)`` threads and, with ``pin``, the rank's own slice
        of ``cpus`` when every rank gets whole cores of its own (else None: no pinning).
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if total is None and not pin:
        return len(cpus), None
    total = len(cpus) if total is None else total
    per = max(1, total // pp_size)
    if not pin or per * pp_size > len(cpus):
        return per, None
    return per, cpus[rank * per:(rank + 1) * per]


def apply_threads(threads: int, cores: list[int] | None) -> None:
    """Pin this process to ``cores`` (when given); ``threads`` for ONNX Runtime's GEMM segments,
    one torch thread (attention of a step is small and its ops are short: waking a second
    thread costs more than it saves)."""
    from runtime.model.cpu.sessions import init_threads
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    init_threads(threads)
