"""How the engine starts a rank process: forked from a forkserver that has torch imported.

A freshly spawned interpreter spends ~2-3 s importing torch and the worker's modules before it
reads a weight (``python -X importtime -c "import runtime.worker.main"``: torch ~2.3 s of ~3 s on
a 2-core CPU machine), and every engine start pays that once per rank. With the ``forkserver``
start method, one server process imports :data:`PRELOAD` once (the first time a rank starts in
this process); every rank after that is a fork of it and starts with those modules loaded.

A fork of the forkserver differs from a spawned interpreter in what it inherits, so
:func:`rank_entry` restores what a spawned rank had:

- the environment: the forkserver keeps the environment it was started with, so the engine sends
  its current ``os.environ`` with every rank (a test's ``monkeypatch.setenv`` before an engine
  starts reaches that engine's ranks, as under spawn);
- the CPU affinity: the forkserver keeps the affinity it was started with, so the engine sends its
  current one (a rank pins itself afterwards under ``--cpu-pin``);
- SIGINT: ignored in every rank (Ctrl-C reaches the engine, which shuts the ranks down in order);
- tqdm's lock: a threading lock (:func:`_thread_lock_for_tqdm`), not tqdm's default, which adds a
  multiprocessing RLock: a named semaphore registered with multiprocessing's resource tracker that
  a rank ended by a signal (SIGTERM to the server's process group) or by ``os._exit`` never
  unregisters, so the tracker warned "leaked semaphore objects" when the engine exited.

What the preloaded modules read from the environment while being imported (torch's import-time
variables, libgomp's ``OMP_NUM_THREADS``) comes from the environment at the first rank start in
this process; every rank sets its thread count itself (``torch.set_num_threads``), and CUDA variables
(``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF``) are read when CUDA initialises, in the rank.
The forkserver holds no project module and no engine configuration: an engine with another
configuration started later in the same process gets ranks as fresh as the first engine's.

Multiprocessing itself carries the working directory, ``sys.path`` and the process name, and reports
each rank's exit status (``Process.exitcode``; ``-9`` for SIGKILL) through the forkserver.

Engine death: the forkserver exits once every holder of its keep-alive pipe has closed it, and
multiprocessing hands a copy to every forked child (so that a child may start processes too). A
rank closes its copy first thing (:func:`_release_forkserver`), so the forkserver lives exactly as
long as the engine process; a serving rank whose engine is gone then sees its parent change and
exits (:meth:`runtime.worker.main._Worker.serve`), as a spawned rank did. A rank elsewhere (in its
torch rendezvous, loading the model, sending ``ready``) would not look before its rendezvous or
send timed out (minutes), so every rank also watches the engine's pid (:func:`watch_engine`, a
daemon thread on a Linux pidfd) and ends :data:`ENGINE_GONE_GRACE_S` seconds after the engine
(``prctl(PR_SET_PDEATHSIG)`` does not fit: a rank's parent is the forkserver, not the engine).

A forked rank ends with ``os._exit`` after its target returns (multiprocessing's fork-based
children do), without the interpreter's finalisation (engine shutdown at PP=2 on a loaded 2-core
machine: 0.6-1.0 s with forked ranks, 3.8-5.2 s with spawned ones, the grace period being 5 s;
benchmarks/results/engine-start-cpu-2026-12-03.json). The rank's own
clean-up is in :func:`runtime.worker.main.run_worker`'s ``finally`` (sockets, zmq context, trace
sink); it registers no ``atexit`` handler.

CUDA is never initialised in the forkserver (importing torch does not), so a rank may pick any
device. Where ``forkserver`` does not exist (not on Linux/macOS), ranks are spawned as before.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.context import BaseContext

#: imported once by the forkserver; the ranks forked from it inherit them. Third-party modules
#: only: the project's own modules are imported by each rank from the source it sees at start.
PRELOAD = ("torch", "numpy", "zmq", "msgspec", "pydantic", "yaml", "transitions")

#: seconds a rank waits, once its engine process is gone, before it ends itself: longer than the
#: serve loop's 1 s look at its parent, so that a serving rank still ends through its own clean-up
ENGINE_GONE_GRACE_S = 2.0

#: exit status of a rank ended by :func:`watch_engine` (nobody reads it: the engine is gone)
EXIT_ENGINE_GONE = 1


def rank_context() -> BaseContext:
    """The multiprocessing context for rank processes: ``forkserver`` preloading :data:`PRELOAD`
    where the platform has it, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def rank_entry(target, args, environ: dict[str, str], cpus: set[int] | None = None,
               engine_pid: int | None = None) -> None:
    """Body of a rank process: SIGINT ignored, the engine's environment ``environ`` and CPU
    affinity ``cpus`` (None: leave it), the engine process ``engine_pid`` watched
    (:func:`watch_engine`; None: not watched), then ``target(args)``.

    Raises:
        OSError: ``cpus`` names no CPU this process may use.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _release_forkserver()
    _thread_lock_for_tqdm()
    if engine_pid is not None:
        watch_engine(engine_pid)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    if cpus is not None and os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)
    target(args)


def engine_cpus() -> set[int] | None:
    """This process's CPU affinity, to pass to :func:`rank_entry` (None where the platform has no
    ``sched_getaffinity``)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/PID/stat`` (``"R"``, ``"S"``, ``"Z"``
    for a zombie, ...), or None when it has no entry (gone, or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]   # after the command name
    except OSError:
        return None


def forkserver_gone(wait_s: float = 0.0) -> bool:
    """Whether the forkserver this process started has ended (no ``/proc`` entry, or a zombie not
    yet reaped), waiting up to ``wait_s`` seconds for it to finish ending: a killed forkserver's
    pipes close (and its children's statuses read 255) before the kernel marks it a zombie.
    False when none was started, and where there is no ``/proc``."""
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None or not os.path.isdir("/proc/self"):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        if process_state(pid) in (None, "Z", "X"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _thread_lock_for_tqdm() -> None:
    """Give tqdm (every bar class: they inherit it) a threading RLock before its first bar, so
    that it never creates its multiprocessing one: a rank's bars are drawn by rank 0 alone."""
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())


def _release_forkserver() -> None:
    """Close this process's copy of the forkserver's keep-alive pipe (the write end every forked
    child inherits; ``multiprocessing.forkserver``'s private ``_forkserver_alive_fd``), so that
    the forkserver exits with the engine. No-op in a spawned process (no copy)."""
    from multiprocessing import forkserver
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        server._forkserver_alive_fd = None
        os.close(fd)


def watch_engine(pid: int, grace_s: float = ENGINE_GONE_GRACE_S,
                 who: str = "rank process", watched: str = "engine process") -> None:
    """End this process (``os._exit(EXIT_ENGINE_GONE)``) ``grace_s`` seconds after process ``pid``
    ends, from a daemon thread, whatever the main thread is blocked in. Ends it at once when
    ``pid`` is already gone. Linux: a pidfd (no pid-reuse race); elsewhere ``os.kill(pid, 0)``
    every 0.5 s (a zombie engine then counts as alive until it is reaped). ``who`` / ``watched``
    name the two processes in the line printed on stderr (the ``--api-server-count`` engine core
    and API servers watch their supervisor with it too)."""
    names = (who, watched)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _engine_gone(pid, names)
    except (AttributeError, OSError):   # no pidfd here (not Linux >= 5.3): poll the pid
        fd = None
    threading.Thread(target=_exit_after_engine, args=(pid, fd, grace_s, names), daemon=True,
                     name="ppstate-engine-watch").start()


def _exit_after_engine(pid: int, fd: int | None, grace_s: float,
                       names: tuple[str, str] = ("rank process", "engine process")) -> None:
    if fd is not None:
        select.select([fd], [], [])     # readable once the process has ended
    else:
        while _exists(pid):
            time.sleep(0.5)
    time.sleep(grace_s)
    _engine_gone(pid, names)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _engine_gone(pid: int, names: tuple[str, str] = ("rank process", "engine process")) -> None:
    print(f"{names[0]} {os.getpid()}: {names[1]} {pid} is gone; exiting", file=sys.stderr,
          flush=True)
    os._exit(EXIT_ENGINE_GONE)
