"""When the engine must die: dead, silent or stalled ranks, a failed step, no step finished in time.

:class:`Liveness` is owned by the :class:`~runtime.engine.async_engine.AsyncEngine`; its result
loop calls :meth:`Liveness.check` every ``HEALTH_CHECK_S`` and :meth:`Liveness.on_rank_error`
when a rank reports a failed step. The verdict goes to the engine's ``die`` callback (which
fails every in-flight request and stops the processes: never a hang).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ppstate.scheduler import Scheduler
from runtime.config import EngineConfig
from runtime.engine.launcher import WorkerPool
from runtime.engine.stall import StallDetector

#: seconds to look for an exited worker process after a rank reported a failed step: when a rank is
#: killed, its peers' collectives fail at once and their report can arrive before the process is
#: reaped; the error then names the dead rank, not only the survivor's "connection closed"
DEAD_PEER_WAIT_S = 0.5


class Liveness:
    """Judges the pipeline's health for one engine.

    Args:
        config: the engine config (``heartbeat_timeout_s``, ``step_timeout_s``).
        pool: the worker processes (dead and silent ranks).
        stalls: the stall detector fed by the ranks' heartbeats.
        sched: the scheduler (whether steps are in flight).
        die: the engine's death with an error message.

    ``last_progress`` (``time.monotonic()`` seconds) is when a step last finished, or when the
    pipeline was last seen idle.
    """

    def __init__(self, config: EngineConfig, pool: WorkerPool, stalls: StallDetector,
                 sched: Scheduler, die: Callable[[str], None]) -> None:
        self.config, self.pool, self.stalls, self.sched, self.die = config, pool, stalls, sched, die
        self.last_progress = time.monotonic()
        self._rank_error: asyncio.Task | None = None   # die_naming_dead after a rank's error
        self._dead_wait: asyncio.Task | None = None    # die_unless_reported after an exit

    def progressed(self) -> None:
        """A step finished now."""
        self.last_progress = time.monotonic()

    def on_rank_error(self, error: str) -> None:
        """A rank reported a failed step: die, naming first any worker process that exited
        within :data:`DEAD_PEER_WAIT_S` (the likely cause of a survivor's failed collective)."""
        if self._rank_error is None:
            self._rank_error = asyncio.get_running_loop().create_task(self.die_naming_dead(error))

    async def die_naming_dead(self, error: str) -> None:
        deadline = time.monotonic() + DEAD_PEER_WAIT_S
        while not (dead := self.pool.dead_ranks()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.die(f"{self.pool.describe_dead(dead)}; then {error}" if dead else error)

    async def die_unless_reported(self, dead: list[int]) -> None:
        """``dead`` ranks exited with a status (no signal): a rank that fails a step reports the
        error, then exits, and its report can reach the engine after its exit is seen. Wait up
        to :data:`DEAD_PEER_WAIT_S` for a rank's error (which then dies naming both); die naming
        the exit alone if none comes."""
        deadline = time.monotonic() + DEAD_PEER_WAIT_S
        while self._rank_error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._rank_error is None:
            self.die(self.pool.describe_dead(self.pool.dead_ranks() or dead))

    def check(self) -> None:
        """Fail the engine when a rank process exited (at once when killed by a signal; within
        :data:`DEAD_PEER_WAIT_S`, naming its error report if one comes, when it exited with a
        status), a rank was silent (no heartbeat) for ``heartbeat_timeout_s``, a rank stalled
        inside a step or every rank waited on communication for ``stall_timeout_s``
        (:mod:`runtime.engine.stall`), or no step finished within ``step_timeout_s``. Call only
        while the engine is alive (from its event loop)."""
        if self._rank_error is not None or self._dead_wait is not None:
            return                                   # a verdict is on its way
        dead = self.pool.dead_ranks()
        silent = self.pool.silent_ranks(self.config.heartbeat_timeout_s)
        if dead and self.pool.exited_by_itself(dead):
            self._dead_wait = asyncio.get_running_loop().create_task(self.die_unless_reported(dead))
        elif dead:
            self.die(self.pool.describe_dead(dead))
        elif silent:
            self.die(f"rank(s) {silent} sent no heartbeat for heartbeat_timeout_s="
                     f"{self.config.heartbeat_timeout_s} s (killed or frozen)")
        elif stall := self.stalls.check():
            self.die(stall)
        elif self.sched.in_flight and time.monotonic() - self.last_progress > self.config.step_timeout_s:
            self.die(f"no step finished within step_timeout_s={self.config.step_timeout_s}")
        elif not self.sched.in_flight:
            self.last_progress = time.monotonic()
