"""A quiet exit when standard output's reader goes away (``python -m ppstate.replay DIR | head``).

Python ignores SIGPIPE, so writing to a pipe whose reader has closed raises ``BrokenPipeError``,
and the interpreter prints a traceback (and a second error when it flushes stdout at exit). The
command-line tools run their ``main`` through :func:`run_main`, the standard recipe of the Python
documentation (``signal`` module, "Note on SIGPIPE"): catch ``BrokenPipeError`` at the entry
point, point stdout at ``os.devnull`` so that the final flush is silent, and exit with
:data:`EXIT_BROKEN_PIPE`, the status a shell reports for a process killed by SIGPIPE.

A ``BrokenPipeError`` that does not come from stdout (a pipe to a worker process) is re-raised.
"""

from __future__ import annotations

import os
import select
import sys
from typing import Callable

#: 128 + SIGPIPE (13): the exit status of ``cmd | head`` when ``cmd`` is killed by SIGPIPE
EXIT_BROKEN_PIPE = 141


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed.

    Polls the descriptor without blocking: a pipe without readers reports ``POLLERR``. Where
    ``select.poll`` is missing (Windows), assumes the reader is gone.
    """
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):   # replaced or closed stdout (tests)
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


def run_main(main: Callable[[], int | None]) -> int:
    """Run ``main()`` and flush stdout; returns its exit status (None counts as 0), or
    :data:`EXIT_BROKEN_PIPE` when stdout's reader closed the pipe (nothing more is printed).

    Raises:
        BrokenPipeError: a broken pipe that is not stdout.
    """
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # the interpreter's last flush goes nowhere
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    return 0 if status is None else status
