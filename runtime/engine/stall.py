"""Stall detection from the ranks' heartbeats (issue #12): a rank alive but stuck inside a step.

Every heartbeat (:class:`runtime.messages.HeartbeatMsg`) says which step and phase the rank is in
and for how many seconds (:mod:`runtime.worker.progress`). :class:`StallDetector` keeps the last
beat of every rank and, when the engine asks, reports a stall when

* one rank has stayed in one **compute** phase (prepare, forward, sample, post) longer than
  ``stall_timeout_s``: its own work is stuck (a hang in its code, a GPU that stopped answering);
* no rank computes, at least one waits in a **communication** phase (recv, send, broadcast-wait)
  and every rank has been in its phase (communication or ``idle``) longer than
  ``stall_timeout_s``: each waits for another, so none can move (a distributed deadlock). An idle
  rank counts: the engine sends every step to all ranks at once, so a rank that waits on a peer
  for a step the peer has long received, while the peer sits idle, will wait forever. One rank
  waiting alone is no stall: it waits as long as its peer computes.

The time in the phase is the beat's ``in_phase_s`` plus the seconds since the engine read the
beat; the engine reads every queued message before it checks (``AsyncEngine._drain``), so a late
read never makes a phase look longer than it was by more than one heartbeat interval.

How long may a legitimate phase take? A step's forward covers at most ``max_num_batched_tokens``
tokens on a rank's layers, so its length is bounded by that budget and the rank's speed; the
default 8 s is far above what the default budget (512 tokens) takes on a CPU (on the 2-core
development machine a full 256-token chunk of the embedded model takes well under a second per
rank). The first step a rank runs (lazy allocations, first touch of the weights, first kernel
compilations on CUDA) gets :data:`WARMUP_FACTOR` times the limit. A slower machine or a larger
model with a large budget needs a larger ``--stall-timeout`` (or a smaller
``--max-num-batched-tokens``); ``--stall-timeout 0`` turns stall detection off (the
``--step-timeout`` still bounds every receive and collective). Source of the scheme: the
progress watchdogs of torch elastic / NCCL's flight recorder (per-rank "what am I waiting for").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from runtime.worker.progress import COMM_PHASES, IDLE

#: the first step of a rank may take this many times ``stall_timeout_s`` in one phase
WARMUP_FACTOR = 3.0


@dataclass
class RankProgress:
    """The last heartbeat of one rank, as the engine saw it.

    Attributes:
        step: step the rank is in (or last finished).
        phase: its phase (``idle`` between steps).
        in_phase_s: seconds in the phase when the beat was sent.
        steps_done: steps the rank finished.
        received: monotonic seconds (engine clock) the beat was read.
        beats_in_phase: consecutive beats that reported this (step, phase).
    """
    step: int
    phase: str
    in_phase_s: float
    steps_done: int
    received: float
    beats_in_phase: int = 1

    def seconds_in_phase(self, now: float) -> float:
        """Seconds in the phase at engine time ``now`` (seconds)."""
        return self.in_phase_s + max(0.0, now - self.received)


class StallDetector:
    """Last heartbeat of each rank and the stall rules above.

    Args:
        pp_size: number of ranks.
        stall_timeout_s: seconds a rank may stay in one compute phase (or every rank in a
            communication phase); 0 turns the detector off.
    """

    def __init__(self, pp_size: int, stall_timeout_s: float) -> None:
        self.pp_size, self.timeout_s = pp_size, stall_timeout_s
        self.ranks: list[RankProgress | None] = [None] * pp_size  # [pp_size]

    def observe(self, beat, now: float | None = None) -> None:
        """Record one heartbeat (``rank``, ``step``, ``phase``, ``in_phase_s``, ``steps_done``)."""
        now = time.monotonic() if now is None else now
        prev = self.ranks[beat.rank]
        same = prev is not None and (prev.step, prev.phase) == (beat.step, beat.phase) and \
            beat.in_phase_s >= prev.in_phase_s
        self.ranks[beat.rank] = RankProgress(
            beat.step, beat.phase, beat.in_phase_s, beat.steps_done, now,
            prev.beats_in_phase + 1 if same else 1)

    def limit_s(self, rp: RankProgress) -> float:
        """The limit for ``rp``'s phase: ``stall_timeout_s``, times :data:`WARMUP_FACTOR` before
        the rank finished its first step."""
        return self.timeout_s * (WARMUP_FACTOR if rp.steps_done == 0 else 1.0)

    def check(self, now: float | None = None) -> str | None:
        """The stall to report (a message naming the rank(s), phase and step), or None."""
        if self.timeout_s <= 0 or any(r is None for r in self.ranks):
            return None
        now = time.monotonic() if now is None else now
        for rank, rp in enumerate(self.ranks):
            if rp.phase not in COMM_PHASES and rp.phase != IDLE and \
                    rp.seconds_in_phase(now) > self.limit_s(rp):
                return (f"rank {rank} stalled in phase '{rp.phase}' of step {rp.step} for "
                        f"{rp.seconds_in_phase(now):.1f} s ({rp.beats_in_phase} heartbeats; "
                        f"stall_timeout_s={self.timeout_s})")
        waiting = [rp.phase in COMM_PHASES for rp in self.ranks]
        if any(waiting) and all((w or rp.phase == IDLE) and rp.seconds_in_phase(now) > self.limit_s(rp)
                                for w, rp in zip(waiting, self.ranks)):
            waits = ", ".join(f"rank {r} in '{rp.phase}' of step {rp.step} for "
                              f"{rp.seconds_in_phase(now):.1f} s ({rp.beats_in_phase} heartbeats)"
                              for r, rp in enumerate(self.ranks))
            return (f"distributed deadlock: no rank computes, every rank waits ({waits}; "
                    f"stall_timeout_s={self.timeout_s})")
        return None
