"""What a rank is doing right now: its step, its phase inside the step, and since when.

The rank's main thread moves through the phases of a step (:meth:`Progress.enter`); the heartbeat
thread (:mod:`runtime.worker.heartbeat`) reads the current value once a second and sends it to
the engine, which declares a stall when a rank stays in one compute phase, or every rank in a
communication phase, longer than ``EngineConfig.stall_timeout_s`` (:mod:`runtime.engine.stall`). The
heartbeat carries the seconds spent in the phase so far, not a timestamp, so that ranks on other
machines (torchrun) need no synchronised clock.

Phases (in step order, :class:`runtime.worker.runner.StageRunner`):

* ``idle``: between steps, waiting for the engine's next step message (never a stall);
* ``broadcast-wait``: non-last rank, overlapped mode: waiting for the sampled tokens of an earlier
  step (the deferred receive); sync mode: the blocking broadcast of this step;
* ``prepare``: slot frees / admissions, block tables, batch metadata;
* ``recv``: waiting for the hidden states of rank - 1;
* ``forward``: this rank's layers over the step's tokens;
* ``send``: handing the hidden states to rank + 1 (waits only when 4 sends are pending);
* ``sample``: last rank: sampling and publishing the tokens;
* ``post``: post-update of the device state and mirror validation.

Test hook (issue #12): ``PPSTATE_TEST_STALL=RANK:PHASE:N`` makes rank RANK sleep inside phase
PHASE of its N-th decode-only step (every row one token) until the process is killed, while its
heartbeat thread keeps beating (``time.sleep`` releases the interpreter lock).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

IDLE = "idle"
#: phases in which a rank waits for a peer; a rank may legitimately wait in one as long as a peer
#: computes, so only "every rank waiting" is a stall (a distributed deadlock)
COMM_PHASES = frozenset({"broadcast-wait", "recv", "send"})
#: phases in which a rank computes: bounded by the step's tokens (max_num_batched_tokens)
COMPUTE_PHASES = frozenset({"prepare", "forward", "sample", "post"})
PHASES = frozenset({IDLE}) | COMM_PHASES | COMPUTE_PHASES
STALL_ENV = "PPSTATE_TEST_STALL"


@dataclass(frozen=True)
class StallHook:
    """The test hook: rank ``rank`` sleeps in ``phase`` of its ``nth`` decode-only step."""
    rank: int
    phase: str
    nth: int

    @classmethod
    def from_env(cls, value: str | None = None) -> "StallHook | None":
        """Parse ``RANK:PHASE:N`` (default: ``$PPSTATE_TEST_STALL``); None when unset or empty.

        Raises:
            ValueError: not ``RANK:PHASE:N`` with RANK >= 0, PHASE one of :data:`PHASES` other
                than ``idle`` and N >= 1 (message names the variable).
        """
        value = os.environ.get(STALL_ENV) if value is None else value
        if not value:
            return None
        parts = value.split(":")
        try:
            rank, phase, nth = int(parts[0]), parts[1], int(parts[2])
            if len(parts) != 3 or rank < 0 or nth < 1 or phase not in PHASES - {IDLE}:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"{STALL_ENV}={value!r}: expected RANK:PHASE:N, e.g. 1:forward:5, "
                             f"PHASE one of {sorted(PHASES - {IDLE})}") from None
        return cls(rank, phase, nth)


class Progress:
    """The rank's current (step, phase, phase start); written by the main thread, read by the
    heartbeat thread (one tuple assignment: readers never see a torn value).

    Args:
        rank: this rank (for the test hook).
        hook: the stall test hook, or None (default: read from ``$PPSTATE_TEST_STALL``).
    """

    def __init__(self, rank: int, hook: StallHook | None = None) -> None:
        self.rank = rank
        self.hook = hook if hook is not None else StallHook.from_env()
        if self.hook is not None and self.hook.rank != rank:
            self.hook = None
        self._state = (-1, IDLE, time.monotonic())  # (step, phase, monotonic s since)
        self.step_started: float | None = None  # monotonic s the current step began (None: idle)
        self.steps_done = 0        # steps finished (result or timing sent)
        self._decode_steps = 0     # decode-only steps begun (for the hook)
        self._stall_now = False

    def begin_step(self, step: int, decode_only: bool) -> None:
        """The rank starts ``step`` (``decode_only``: every row schedules one token)."""
        if decode_only:
            self._decode_steps += 1
        self._stall_now = self.hook is not None and decode_only and \
            self._decode_steps == self.hook.nth
        self.step_started = time.monotonic()
        self._state = (step, "prepare", self.step_started)

    def enter(self, phase: str) -> None:
        """The main thread enters ``phase`` of the current step (the test hook may sleep here)."""
        self._state = (self._state[0], phase, time.monotonic())
        if self._stall_now and phase == self.hook.phase:
            self._stall_now = False
            _sleep_until_killed()

    def end_step(self) -> None:
        """The step's reply is sent: back to ``idle``."""
        self.steps_done += 1
        self.step_started = None
        self._state = (self._state[0], IDLE, time.monotonic())

    def snapshot(self) -> tuple[int, str, float]:
        """``(step, phase, seconds in phase so far)``."""
        step, phase, since = self._state
        return step, phase, time.monotonic() - since


def _sleep_until_killed() -> None:
    """The hook's stall: sleep (the heartbeat thread runs on) until the engine kills this
    process; exit by itself if the engine process is gone, so that no orphan remains."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)
