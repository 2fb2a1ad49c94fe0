"""Process checks from /proc shared by the tests that prove no process is left behind."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (state ``Z`` in ``/proc/PID/stat``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
