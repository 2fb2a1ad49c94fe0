"""A rank's heartbeat: a daemon thread that tells the engine, once a second, that the process is
alive and not frozen, and which step it is in.

It has its own zmq PUSH socket (zmq sockets are not thread-safe; the context is). A rank killed
(SIGKILL) or frozen (SIGSTOP, a hang holding the GIL) stops beating; the engine fails every
in-flight request once a rank has been silent for ``EngineConfig.heartbeat_timeout_s`` seconds
(see :meth:`runtime.engine.launcher.WorkerPool.silent_ranks`). A rank alive but stuck inside one step
(e.g. waiting on a collective whose peer hangs) keeps beating; its ``in_step_s`` grows, and
``step_timeout_s`` (the limit on every receive and collective, and the engine's progress check)
ends it. Source of the scheme: torch elastic's / vLLM's worker liveness checks (heartbeats plus
collective timeouts).
"""

from __future__ import annotations

import threading
import time

import zmq

from runtime import transport as tp

HEARTBEAT_INTERVAL_S = 1.0  # seconds between two beats


class Heartbeat:
    """Beat for ``rank`` to ``result_addr`` until :meth:`stop`.

    Args:
        ctx: the rank's zmq context (shared with its other sockets).
        result_addr: the engine's result PULL address.
        rank: this rank.
        interval_s: seconds between beats.
    """

    def __init__(self, ctx: zmq.Context, result_addr: str, rank: int,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.ctx, self.addr, self.rank, self.interval_s = ctx, result_addr, rank, interval_s
        self.step = -1                      # step in progress or last finished
        self.step_started: float | None = None  # monotonic time the current step began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def enter_step(self, step: int) -> None:
        """Called by the rank's main thread when it starts ``step``."""
        self.step, self.step_started = step, time.monotonic()

    def leave_step(self) -> None:
        """Called when the step is done (its reply sent)."""
        self.step_started = None

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most two intervals)."""
        self._stop.set()
        self._thread.join(2 * self.interval_s)

    def _run(self) -> None:
        sock = tp.make_push(self.ctx, self.addr, bind=False, linger_ms=0, hwm=4)
        try:
            while not self._stop.is_set():
                started = self.step_started
                beat = tp.HeartbeatMsg(rank=self.rank, step=self.step,
                                       in_step_s=0.0 if started is None else time.monotonic() - started)
                try:
                    sock.send(tp.encode(beat), zmq.NOBLOCK)
                except zmq.Again:  # engine not reading (gone or busy): a later beat will do
                    pass
                self._stop.wait(self.interval_s)
        finally:
            sock.close(0)
