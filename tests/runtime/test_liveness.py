"""runtime.engine.liveness: the verdict when a rank process is found exited.

A rank that fails a step sends its error report, then exits with a status; the engine's health
check can see the exit before the report is read (found under load: a planted MirrorDivergence
on TP rank 1 of stage 1 was reported as 'worker process of rank(s) [3] died (rank 3: exit
status 0)', the divergence lost). A rank that exited by itself gets DEAD_PEER_WAIT_S for its
report; a rank killed by a signal could send none, and is named at once.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from runtime.engine import liveness as lv
from runtime.engine.launcher import WorkerPool


class FakePool:
    """The part of WorkerPool that Liveness reads: rank 1 has exited with ``exitcode``."""

    def __init__(self, exitcode: int) -> None:
        self.local_ranks = [0, 1]
        self.procs = [SimpleNamespace(exitcode=None, is_alive=lambda: True),
                      SimpleNamespace(exitcode=exitcode, is_alive=lambda: False)]

    dead_ranks = WorkerPool.dead_ranks
    exited_by_itself = WorkerPool.exited_by_itself
    describe_dead = WorkerPool.describe_dead

    def silent_ranks(self, timeout_s: float) -> list[int]:
        return []


def _liveness(exitcode: int) -> tuple[lv.Liveness, list[tuple[float, str]]]:
    died: list[tuple[float, str]] = []
    config = SimpleNamespace(heartbeat_timeout_s=30.0, step_timeout_s=60.0)
    stalls = SimpleNamespace(check=lambda: None)
    sched = SimpleNamespace(in_flight=0)
    live = lv.Liveness(config, FakePool(exitcode), stalls, sched,
                       lambda error: died.append((time.monotonic(), error)))
    return live, died


def test_an_exit_seen_before_the_report_is_named_with_the_report():
    async def go():
        live, died = _liveness(0)
        live.check()
        assert died == []                              # waits for a report
        await asyncio.sleep(0.05)
        live.on_rank_error("rank 1 failed at step 7: MirrorDivergence: pp rank 1 ...")
        live.check()                                   # a verdict is on its way: no second one
        await asyncio.sleep(lv.DEAD_PEER_WAIT_S + 0.3)
        return died
    died = asyncio.run(go())
    assert [e for _, e in died] == ["worker process of rank(s) [1] died (rank 1: exit status 0); "
                                    "then rank 1 failed at step 7: MirrorDivergence: pp rank 1 ..."]


def test_an_exit_without_a_report_is_named_after_the_wait():
    async def go():
        live, died = _liveness(3)
        t0 = time.monotonic()
        live.check()
        await asyncio.sleep(lv.DEAD_PEER_WAIT_S + 0.3)
        live.check()
        return t0, died
    t0, died = asyncio.run(go())
    assert [e for _, e in died] == ["worker process of rank(s) [1] died (rank 1: exit status 3)"]
    assert died[0][0] - t0 >= lv.DEAD_PEER_WAIT_S


def test_a_rank_killed_by_a_signal_is_named_at_once():
    async def go():
        live, died = _liveness(-9)
        live.check()
        return died
    assert [e for _, e in asyncio.run(go())] == [
        "worker process of rank(s) [1] died (rank 1: killed by SIGKILL)"]
