"""How the ranks of one pipeline share the machine's cores on the CPU fast path.

The stages of a pipeline run at the same time (overlapped schedule), so each rank gets its own
share of the threads rather than every rank spreading over all cores (two stages would then fight
for the same cores and both slow down; ``python -m runtime.bench contention``). Pinning each rank
to its own cores (``--cpu-pin``) is off by default: on the shared 2-core machine a pinned rank
could not move off a core busy with other jobs, and PP=2 served 1.3-3x slower pinned
(``benchmarks/results/cpu-serve-2026-12-02-round2.json``).
"""

from __future__ import annotations

import os

import torch


def plan_threads(total: int | None, pp_size: int, rank: int,
                 cpus: list[int] | None = None) -> tuple[int, list[int] | None]:
    """Threads and cores of ``rank``.

    Args:
        total: threads for the whole pipeline (None: every core this process may use).
        pp_size: stages; rank: this stage's rank.
        cpus: the cores this process may use (default: ``os.sched_getaffinity(0)``).
    Returns:
        ``(threads, cores)``: ``max(1, total // pp_size)`` threads; the rank's own slice of
        ``cpus`` when every rank gets whole cores of its own, else None (no pinning).
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    total = len(cpus) if total is None else total
    per = max(1, total // pp_size)
    if per * pp_size > len(cpus):
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
