"""CPU accounting and pinning of an engine's processes for the engine benchmarks (Linux ``/proc``).

``python -m runtime.bench pp --overheads`` compares two engines whose rank processes run side by
side on one host: their CPU time per step is the figure a host-bound rank's throughput follows,
and each engine's idle ranks must not take cores from the other's busy ones.

* :func:`process_cpu_s`: user + system seconds of a process in clock ticks (``/proc/PID/stat``,
  10 ms at the usual 100 Hz: a 0.3 s round is only ~30 ticks);
* :func:`tasks_cpu_s`: the same from the scheduler's nanosecond run time of every thread of
  the process (``/proc/PID/task/TID/schedstat``, first field), falling back to the ticks;
* :func:`pin`: every thread of a process onto a set of cores (``sched_setaffinity`` per thread;
  threads started later inherit it from the one that starts them);
* :func:`split_cores`: the cores this process may use, in three disjoint groups (the benchmark's
  own process, engine ``off``'s ranks, engine ``on``'s ranks).
"""

from __future__ import annotations

import os


def process_cpu_s(pid: int, gone: float | None = 0.0) -> float | None:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc/PID/stat``, fields 14 and 15
    in clock ticks); ``gone`` when it is gone or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # after the command name
    except OSError:
        return gone
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def tasks_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of ``pid`` from ``/proc/PID/task/TID/schedstat``
    (nanoseconds on a CPU); :func:`process_cpu_s` where schedstat is absent; 0 when the
    process is gone."""
    tids = _tids(pid)
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return process_cpu_s(pid)
    return total / 1e9 if tids else 0.0


def pin(pid: int, cores: set[int]) -> int:
    """Put every thread of ``pid`` on ``cores``; returns how many threads were pinned (a thread
    that exits meanwhile is skipped)."""
    done = 0
    for tid in _tids(pid):
        try:
            os.sched_setaffinity(tid, cores)
            done += 1
        except OSError:
            pass
    return done


def split_cores(groups: int = 3) -> list[set[int]] | None:
    """The cores of this process's affinity in ``groups`` disjoint groups of equal size (the
    first gets the remainder); None when there are fewer than two cores per group."""
    cores = sorted(os.sched_getaffinity(0))
    size = len(cores) // groups
    if size < 2:
        return None
    first = len(cores) - size * (groups - 1)
    out = [set(cores[:first])]
    out += [set(cores[first + i * size:first + (i + 1) * size]) for i in range(groups - 1)]
    return out
