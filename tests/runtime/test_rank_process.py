"""Rank processes forked from the forkserver (runtime/engine/rank_process.py) start like spawned
ones: they see the engine's environment, working directory and CPU affinity at the time they start
(not the forkserver's), ignore SIGINT, find torch imported but neither CUDA initialised nor any of
the project's modules loaded, and report how they ended through ``Process.exitcode``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, descendants, parents
from tiny_models import write_tiny_llama

from runtime.engine.rank_process import (ENGINE_GONE_GRACE_S, EXIT_ENGINE_GONE, PRELOAD, engine_cpus,
                                         rank_context, rank_entry)

pytestmark = pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(),
                                reason="no forkserver here")

VAR = "PPSTATE_TEST_RANK_PROCESS"


def report(conn) -> None:
    """Send what a rank sees before it imports anything itself."""
    mods = sys.modules
    conn.send({"var": os.environ.get(VAR), "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
               "torch": "torch" in mods, "cuda": "torch" in mods and mods["torch"].cuda.is_initialized(),
               "project": sorted(m for m in mods if m.split(".")[0] in ("ppstate", "runtime")
                                 and m not in ("runtime", "runtime.engine", "runtime.engine.rank_process")),
               "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0))})
    conn.close()


def kill_self(_args) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_3(_args) -> None:
    sys.exit(3)


def sleep_long(_args) -> None:
    time.sleep(600)


def start(target, args, cpus=None, engine_pid=None) -> mp.Process:
    p = rank_context().Process(target=rank_entry, args=(target, args, dict(os.environ), cpus, engine_pid),
                               daemon=True)
    p.start()
    return p


def seen_by_a_rank(cpus=None) -> dict:
    recv, send = rank_context().Pipe(duplex=False)
    p = start(report, send, cpus)
    send.close()
    assert recv.poll(120)
    out = recv.recv()
    p.join(60)
    assert p.exitcode == 0
    return out


def test_context_is_a_forkserver_preloading_third_party_modules_only():
    ctx = rank_context()
    assert ctx.get_start_method() == "forkserver"
    assert "torch" in PRELOAD and not [m for m in PRELOAD if m.split(".")[0] in ("ppstate", "runtime")]


def test_each_rank_sees_the_engine_state_at_its_own_start(monkeypatch, tmp_path):
    """Two ranks started after the forkserver runs, with different environments: each sees its own
    (nothing of the first stays in the forkserver)."""
    first = start(kill_self, None)          # the forkserver now runs, with this environment
    first.join(60)
    monkeypatch.setenv(VAR, "after-the-forkserver-started")
    monkeypatch.chdir(tmp_path)
    one = sorted(engine_cpus())[:1]
    assert seen_by_a_rank({one[0]}) == {
        "var": "after-the-forkserver-started", "sigint_ignored": True, "torch": True, "cuda": False,
        "project": [], "cwd": str(tmp_path), "cpus": one}
    monkeypatch.setenv(VAR, "second")
    second = seen_by_a_rank(engine_cpus())
    assert (second["var"], second["cpus"]) == ("second", sorted(engine_cpus()))


def test_exit_status_of_a_rank_is_reported():
    killed, exited = start(kill_self, None), start(exit_3, None)
    killed.join(60)
    exited.join(60)
    assert (killed.exitcode, exited.exitcode) == (-signal.SIGKILL, 3)


def wait_orphaned(path: str) -> None:
    """Write this pid to ``path``, then wait until this process's parent (the forkserver) is gone."""
    parent = os.getppid()
    Path(path).write_text(str(os.getpid()))
    while os.getppid() == parent:
        time.sleep(0.05)


ENGINE = """
import sys, time
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/../helpers"]
from runtime.engine.rank_process import rank_context, rank_entry
from test_rank_process import wait_orphaned
rank_context().Process(target=rank_entry, args=(wait_orphaned, sys.argv[1], {}), daemon=True).start()
time.sleep(600)
"""


def bar_then_sigterm(_args) -> None:
    from tqdm.auto import tqdm
    for _ in tqdm(range(2), disable=True):   # a disabled bar takes tqdm's lock too
        pass
    os.kill(os.getpid(), signal.SIGTERM)


TERMED = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/../helpers"]
from runtime.engine.rank_process import rank_context, rank_entry
from test_rank_process import bar_then_sigterm
p = rank_context().Process(target=rank_entry, args=(bar_then_sigterm, None, {}), daemon=True)
p.start()
p.join(60)
print(p.exitcode)
"""


def test_a_rank_ended_by_sigterm_leaves_no_semaphore_to_the_resource_tracker():
    """A rank that drew a tqdm bar and was ended by SIGTERM (as by a SIGTERM to the server's
    process group): the engine exits without multiprocessing's resource-tracker warning (it
    warned "There appear to be 1 leaked semaphore objects": tqdm's multiprocessing lock)."""
    res = subprocess.run([sys.executable, "-c", TERMED, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert (res.returncode, res.stdout) == (0, f"{-signal.SIGTERM}\n")
    assert "leaked" not in res.stderr, res.stderr


def test_a_rank_outlives_a_killed_engine_by_little(tmp_path):
    """SIGKILL to the engine process: its forkserver exits, so the rank sees its parent change
    (what runtime.worker.main._Worker.serve checks each second) and ends."""
    pid_file = tmp_path / "rank.pid"
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(pid_file), str(Path(__file__).parent)])
    try:
        for _ in range(1200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        rank = int(pid_file.read_text())
        assert alive(rank)
    finally:
        engine.kill()
        engine.wait(30)
    for _ in range(600):
        if not alive(rank):
            break
        time.sleep(0.1)
    left = alive(rank)
    if left:
        os.kill(rank, signal.SIGKILL)   # leave no orphan behind a failure
    assert not left


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` still alive after ``within_s`` seconds (SIGKILLed then, leaving no orphan)."""
    deadline = time.monotonic() + within_s
    while [p for p in pids if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def test_a_rank_ends_after_its_engine_whatever_it_is_blocked_in():
    """The watched engine pid ends while the rank sleeps in its target: the rank ends
    ENGINE_GONE_GRACE_S later with EXIT_ENGINE_GONE; an engine already gone ends it at once."""
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    rank = start(sleep_long, None, engine_pid=engine.pid)
    engine.wait(30)
    t0 = time.monotonic()
    rank.join(60)
    assert rank.exitcode == EXIT_ENGINE_GONE and time.monotonic() - t0 < ENGINE_GONE_GRACE_S + 10
    late = start(sleep_long, None, engine_pid=engine.pid)   # engine pid reaped: gone before the rank
    late.join(60)
    assert late.exitcode == EXIT_ENGINE_GONE


def test_ranks_end_promptly_when_the_engine_is_killed_during_start_up(tmp_path):
    """SIGKILL to an engine (tiny model, CPU, PP=2) and its rank 1 as soon as both ranks exist,
    long before they are ready: rank 0, left alone in its torch rendezvous, ends within seconds
    (before the ranks watched the engine's pid it stayed until the rendezvous timed out, 120 s)."""
    write_tiny_llama(tmp_path)
    engine = subprocess.Popen([sys.executable, "-m", "runtime.generate", "--model", str(tmp_path),
                               "--pp", "2", "--max-model-len", "64", "--prompt", "t3", "--max-tokens", "1"],
                              stdout=(tmp_path / "out").open("wb"), stderr=subprocess.DEVNULL,
                              cwd=Path(__file__).resolve().parents[2])
    ranks: list[int] = []
    try:
        for _ in range(1200):
            parent_of = parents()   # the ranks: children of the engine's children (its forkserver)
            ranks = [p for p in descendants(engine.pid) if parent_of.get(p) != engine.pid]
            if len(ranks) == 2:
                break
            time.sleep(0.05)
    finally:
        engine.kill()
        if len(ranks) == 2:
            os.kill(ranks[1], signal.SIGKILL)
        engine.wait(30)
    assert len(ranks) == 2 and engine.returncode == -signal.SIGKILL
    assert (tmp_path / "out").read_bytes() == b""   # killed before it generated anything
    assert wait_gone(ranks, within_s=ENGINE_GONE_GRACE_S + 13) == []


FORKSERVER_KILLED = """
import os, signal, sys, time
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/../helpers"]
from multiprocessing import forkserver
from runtime.engine.launcher import describe_exit
from runtime.engine.rank_process import rank_context, rank_entry
from test_rank_process import wait_orphaned
p = rank_context().Process(target=rank_entry, args=(wait_orphaned, sys.argv[1], {}), daemon=True)
p.start()
while not (os.path.exists(sys.argv[1]) and open(sys.argv[1]).read()):
    time.sleep(0.05)
before = describe_exit(255)
os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
p.join(60)
print(p.exitcode, before, describe_exit(p.exitcode), sep="|")
"""


def test_a_killed_forkserver_is_named_as_why_the_exit_status_is_unknown(tmp_path):
    """SIGKILL to the ranks' forkserver: the rank ends (its parent changed) and multiprocessing
    reports 255, its "unknown"; the engine's description says why instead of "exit status 255"."""
    res = subprocess.run([sys.executable, "-c", FORKSERVER_KILLED, str(tmp_path / "rank.pid"),
                          str(Path(__file__).parent)], capture_output=True, text=True, timeout=120)
    assert res.stdout == ("255|exit status 255|exit status unknown: the ranks' forkserver, which "
                          "reports it, is gone\n"), res.stderr


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_only_the_spawning_of_a_process_ignores_sigint(method, monkeypatch):
    """The first rank forked from a fresh forkserver waits for its preload (torch: seconds): the
    engine started it with SIGINT ignored all that time, so a Ctrl-C then was lost and the
    server went on to serve. Now only the forkserver's spawn (or a spawned rank's, which does
    not wait) ignores SIGINT; the rank's start from the forkserver keeps the engine's handler."""
    from multiprocessing import forkserver

    from runtime.engine.launcher import _start_ignoring_sigint
    seen = []
    monkeypatch.setattr(forkserver, "ensure_running",
                        lambda: seen.append(("forkserver", signal.getsignal(signal.SIGINT))))

    class Rank:
        def start(self) -> None:
            seen.append(("rank", signal.getsignal(signal.SIGINT)))

    def engine_handler(signum, frame) -> None:
        """The engine's own SIGINT handler (identity checked only; never called)."""
    previous = signal.signal(signal.SIGINT, engine_handler)
    try:
        _start_ignoring_sigint(Rank(), mp.get_context(method))
        assert signal.getsignal(signal.SIGINT) is engine_handler
    finally:
        signal.signal(signal.SIGINT, previous)
    want = {"forkserver": [("forkserver", signal.SIG_IGN), ("rank", engine_handler)],
            "spawn": [("rank", signal.SIG_IGN)]}
    assert seen == want[method]
