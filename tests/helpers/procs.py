"""Process checks from /proc shared by the tests that prove no process is left behind."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (state ``Z`` in ``/proc/PID/stat``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def parents() -> dict[int, int]:
    """Parent pid of every process (from /proc)."""
    parent_of = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            parent_of[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parent_of


def descendants(pid: int) -> list[int]:
    """Pids of ``pid``'s children, their children and so on: the rank processes are children of
    the engine's forkserver (runtime/engine/rank_process.py)."""
    parent_of = parents()
    out, frontier = [], {pid}
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier}
        out += sorted(frontier)
    return out
