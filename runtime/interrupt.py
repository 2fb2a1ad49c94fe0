"""Ctrl-C while a command line starts up: one line and exit status 130, no traceback.

``python -m runtime.serve`` and ``python -m runtime.generate`` import for seconds (torch,
FastAPI, the model code) before their ``main`` handles anything; a Ctrl-C in that time raised
KeyboardInterrupt inside some import and Python printed its traceback. Their modules call
:func:`quiet_start` first thing when run as ``__main__``: from then until :func:`started`, SIGINT
prints ``interrupted`` to stderr and exits with status 130 (a ``SystemExit``: ``finally`` blocks
and atexit handlers run). ``main`` calls :func:`started` where its own handling takes over (its
``except KeyboardInterrupt``; asyncio.run's Ctrl-C handling, which asyncio installs only over
Python's default handler): Python's default handler is back, so no later Ctrl-C is swallowed.

Only the standard library is imported here: this module loads before everything else.
"""

from __future__ import annotations

import signal
import sys

#: the exit status of a command ended by Ctrl-C (128 + SIGINT), as a shell reports it
EXIT_INTERRUPTED = 130


def exit_interrupted(signum: int, frame: object) -> None:  # noqa: ARG001 - a signal handler
    """The SIGINT handler while starting: ``interrupted`` on stderr, then exit status 130.

    Raises:
        SystemExit: always, with code :data:`EXIT_INTERRUPTED`.
    """
    print("interrupted", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)


def quiet_start() -> None:
    """Make a Ctrl-C exit quietly (:func:`exit_interrupted`) until :func:`started`. Left alone
    when SIGINT is not at Python's default handler (e.g. ignored for a background job)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, exit_interrupted)


def started() -> None:
    """Put Python's default SIGINT handler back (KeyboardInterrupt) if :func:`quiet_start`
    installed its own; otherwise change nothing (``main`` called in-process, by tests)."""
    if signal.getsignal(signal.SIGINT) is exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
