"""A rank's heartbeat: a daemon thread that tells the engine, once a second, that the process is
alive and not frozen, and what it is doing: its step, its phase in the step and for how long
(:class:`runtime.worker.progress.Progress`).

It has its own zmq PUSH socket (zmq sockets are not thread-safe; the context is). A rank killed
(SIGKILL) or frozen (SIGSTOP, a hang holding the GIL) stops beating; the engine fails every
in-flight request once a rank has been silent for ``EngineConfig.heartbeat_timeout_s`` seconds
(see :meth:`runtime.engine.launcher.WorkerPool.silent_ranks`). A rank alive but stuck inside one step
(a hang in its own code, or waiting on a collective whose peer hangs) keeps beating; its
``in_phase_s`` grows, and the engine declares a stall after ``stall_timeout_s``
(:mod:`runtime.engine.stall`); ``step_timeout_s`` (the limit on every receive and collective, and the
engine's progress check) is the last resort. Source of the scheme: torch elastic's / vLLM's
worker liveness checks (heartbeats plus collective timeouts).
"""

from __future__ import annotations

import threading
import time

import zmq

from runtime import transport as tp
from runtime.worker.progress import Progress

HEARTBEAT_INTERVAL_S = 1.0  # seconds between two beats


class Heartbeat:
    """Beat for ``rank`` to ``result_addr`` until :meth:`stop`.

    Args:
        ctx: the rank's zmq context (shared with its other sockets).
        result_addr: the engine's result PULL address.
        rank: this rank.
        interval_s: seconds between beats.
        progress: what the rank's main thread is doing (read at every beat).
    """

    def __init__(self, ctx: zmq.Context, result_addr: str, rank: int,
                 interval_s: float = HEARTBEAT_INTERVAL_S, progress: Progress | None = None) -> None:
        self.ctx, self.addr, self.rank, self.interval_s = ctx, result_addr, rank, interval_s
        self.progress = progress if progress is not None else Progress(rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most two intervals)."""
        self._stop.set()
        self._thread.join(2 * self.interval_s)

    def beat(self) -> tp.HeartbeatMsg:
        """The message of one beat, from the rank's current :class:`Progress`."""
        p = self.progress
        step, phase, in_phase = p.snapshot()
        started = p.step_started
        return tp.HeartbeatMsg(rank=self.rank, step=step, phase=phase, in_phase_s=in_phase,
                               in_step_s=0.0 if started is None else time.monotonic() - started,
                               steps_done=p.steps_done)

    def _run(self) -> None:
        sock = tp.make_push(self.ctx, self.addr, bind=False, linger_ms=0, hwm=4)
        try:
            while not self._stop.is_set():
                beat = self.beat()
                try:
                    sock.send(tp.encode(beat), zmq.NOBLOCK)
                except zmq.Again:  # engine not reading (gone or busy): a later beat will do
                    pass
                self._stop.wait(self.interval_s)
        finally:
            sock.close(0)
