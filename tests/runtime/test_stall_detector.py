"""Stall rules of :mod:`runtime.engine.stall` over explicit heartbeat sequences (engine clock given), and
the rank-side :mod:`runtime.worker.progress` (phases, the ``PPSTATE_TEST_STALL`` hook's parsing)."""

from __future__ import annotations

import pytest

from runtime.messages import HeartbeatMsg
from runtime.engine.stall import WARMUP_FACTOR, StallDetector
from runtime.worker.progress import STALL_ENV, Progress, StallHook


def beat(rank, step, phase, in_phase_s, steps_done=5):
    return HeartbeatMsg(rank=rank, step=step, phase=phase, in_phase_s=in_phase_s,
                        steps_done=steps_done)


def test_no_verdict_until_every_rank_beat_and_never_when_off():
    d = StallDetector(2, 10.0)
    d.observe(beat(0, 7, "forward", 50.0), now=0.0)
    assert d.check(now=0.0) is None                     # rank 1 not heard yet
    off = StallDetector(2, 0.0)
    for r in (0, 1):
        off.observe(beat(r, 7, "forward", 50.0), now=0.0)
    assert off.check(now=100.0) is None


def test_one_rank_in_a_compute_phase_past_the_timeout_is_a_stall():
    d = StallDetector(2, 10.0)
    d.observe(beat(0, 40, "broadcast-wait", 0.5), now=0.0)
    for t in range(10):                                 # rank 1 beats once a second in forward
        d.observe(beat(1, 41, "forward", float(t)), now=float(t))
    assert d.ranks[1].beats_in_phase == 10
    assert d.check(now=9.5) is None                     # 9.5 s in forward
    msg = d.check(now=10.5)                             # 10.5 s
    assert msg == ("rank 1 stalled in phase 'forward' of step 41 for 10.5 s (10 heartbeats; "
                   "stall_timeout_s=10.0)")


def test_a_new_step_or_phase_restarts_the_count():
    d = StallDetector(1, 10.0)
    d.observe(beat(0, 3, "forward", 8.0), now=0.0)
    d.observe(beat(0, 3, "forward", 9.0), now=1.0)
    assert d.ranks[0].beats_in_phase == 2
    d.observe(beat(0, 4, "forward", 0.2), now=2.0)      # the next step
    assert d.ranks[0].beats_in_phase == 1 and d.check(now=2.0) is None
    d.observe(beat(0, 4, "sample", 0.1), now=3.0)
    assert (d.ranks[0].phase, d.ranks[0].beats_in_phase) == ("sample", 1)


def test_one_rank_waiting_on_communication_is_no_stall():
    """A rank waits in recv / broadcast-wait as long as its peer computes (a long prefill)."""
    d = StallDetector(2, 10.0)
    d.observe(beat(0, 9, "broadcast-wait", 30.0), now=0.0)
    d.observe(beat(1, 9, "forward", 5.0), now=0.0)
    assert d.check(now=1.0) is None
    d.observe(beat(1, 9, "idle", 30.0), now=0.0)        # rank 1 idle 30 s, rank 0 waiting 30 s
    assert d.check(now=1.0).startswith("distributed deadlock")


def test_every_rank_waiting_is_a_deadlock_naming_each_rank():
    d = StallDetector(3, 10.0)
    d.observe(beat(0, 20, "broadcast-wait", 11.0), now=0.0)
    d.observe(beat(1, 21, "recv", 12.0), now=0.0)
    d.observe(beat(2, 21, "idle", 4.0), now=0.0)
    assert d.check(now=5.0) is None                     # rank 2 idle for 9 s only
    assert d.check(now=6.5) == (
        "distributed deadlock: no rank computes, every rank waits (rank 0 in 'broadcast-wait' of "
        "step 20 for 17.5 s (1 heartbeats), rank 1 in 'recv' of step 21 for 18.5 s (1 heartbeats), "
        "rank 2 in 'idle' of step 21 for 10.5 s (1 heartbeats); stall_timeout_s=10.0)")


def test_all_idle_is_never_a_stall():
    d = StallDetector(2, 10.0)
    for r in (0, 1):
        d.observe(beat(r, 99, "idle", 500.0), now=0.0)
    assert d.check(now=1000.0) is None


def test_first_step_gets_the_warmup_allowance():
    d = StallDetector(1, 10.0)
    d.observe(beat(0, 0, "forward", 25.0, steps_done=0), now=0.0)
    assert d.check(now=0.0) is None and 25.0 < 10.0 * WARMUP_FACTOR
    assert "stalled in phase 'forward' of step 0" in d.check(now=6.0)   # 31 s > 30 s
    d.observe(beat(0, 1, "forward", 11.0, steps_done=1), now=6.0)
    assert "of step 1 for 11.0 s" in d.check(now=6.0)


def test_stall_hook_parsing_names_the_variable():
    assert StallHook.from_env("1:forward:5") == StallHook(1, "forward", 5)
    assert StallHook.from_env("") is None
    for bad in ("1:forward", "x:forward:1", "1:idle:1", "1:fwd:1", "-1:recv:1", "0:recv:0",
                "1:recv:2:3"):
        with pytest.raises(ValueError, match=STALL_ENV):
            StallHook.from_env(bad)


def test_progress_phases_and_the_hook_only_on_its_rank(monkeypatch):
    monkeypatch.setenv(STALL_ENV, "1:forward:1")
    assert Progress(0).hook is None and Progress(1).hook == StallHook(1, "forward", 1)
    p = Progress(0)
    assert p.snapshot()[:2] == (-1, "idle") and p.step_started is None
    p.begin_step(3, decode_only=False)
    p.enter("forward")                                 # rank 0: the hook is not its
    assert p.snapshot()[:2] == (3, "forward") and p.step_started is not None
    p.end_step()
    assert p.snapshot()[:2] == (3, "idle") and p.steps_done == 1 and p.step_started is None
