"""Rank processes forked from the forkserver (runtime/engine/rank_process.py) start like spawned
ones: they see the engine's environment at the time they start (not the forkserver's), ignore
SIGINT, and report how they ended through ``Process.exitcode``."""

from __future__ import annotations

import os
import signal

import pytest

from runtime.engine.rank_process import PRELOAD, rank_context, rank_entry

pytestmark = pytest.mark.skipif("forkserver" not in __import__("multiprocessing")
                                .get_all_start_methods(), reason="no forkserver here")

VAR = "PPSTATE_TEST_RANK_PROCESS"


def report(conn) -> None:
    """Send what a rank would see: the variable, the SIGINT disposition, whether torch (preloaded)
    is already imported before this function imports anything."""
    import sys
    conn.send((os.environ.get(VAR), signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
               "torch" in sys.modules, os.getcwd()))
    conn.close()


def kill_self(_args) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _run(ctx, target, args):
    p = ctx.Process(target=rank_entry, args=(target, args, dict(os.environ)), daemon=True)
    p.start()
    return p


def test_rank_sees_the_environment_at_its_start_and_ignores_sigint(monkeypatch, tmp_path):
    ctx = rank_context()
    assert ctx.get_start_method() == "forkserver" and "torch" in PRELOAD
    first = _run(ctx, kill_self, None)      # the forkserver now runs, with the old environment
    first.join(60)
    monkeypatch.setenv(VAR, "after-the-forkserver-started")
    monkeypatch.chdir(tmp_path)
    recv, send = ctx.Pipe(duplex=False)
    p = _run(ctx, report, send)
    send.close()
    assert recv.poll(60)
    assert recv.recv() == ("after-the-forkserver-started", True, True, str(tmp_path))
    p.join(60)
    assert p.exitcode == 0


def test_exit_status_of_a_killed_rank_is_reported():
    p = _run(rank_context(), kill_self, None)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
