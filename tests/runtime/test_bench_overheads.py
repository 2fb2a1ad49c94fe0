"""``runtime.bench pp --overheads`` (runtime/bench/pp_overheads.py): the on / off ratios of the
rounds, and the worker CPU seconds read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime.bench.pp_overheads import process_cpu_s, summarize
from runtime.bench.proc_cpu import pin, split_cores, tasks_cpu_s


# a child process: 0.3 s of CPU on its main (only) thread, then a line, then it waits to be killed
BURN_THEN_WAIT = ("import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end:\n"
                  "    pass\nprint('burned', flush=True)\ntime.sleep(60)\n")


def _run(tok_s: float, busy: float, cpu: float) -> dict:
    return {"output_tokens_per_s": tok_s, "busy_s_per_step": [busy], "worker_cpu_s_per_step": cpu}


def test_summary_pairs_rounds_in_order_and_takes_medians():
    runs = {"off": [_run(100, 2e-3, 4e-3), _run(200, 1e-3, 2e-3), _run(50, 4e-3, 8e-3)],
            "on": [_run(98, 2e-3, 5e-3), _run(210, 1.5e-3, 2e-3), _run(40, 4e-3, 6e-3)]}
    s = summarize(128, runs)
    assert s["concurrency"] == 128 and s["runs"] is runs
    assert s["on_over_off"]["all"] == pytest.approx([0.98, 1.05, 0.8])
    assert (s["on_over_off"]["median"], s["on_over_off"]["min"], s["on_over_off"]["max"]) == \
        pytest.approx((0.98, 0.8, 1.05))
    assert s["busy_per_step_on_over_off"]["all"] == pytest.approx([1.0, 1.5, 1.0])
    assert s["worker_cpu_per_step_on_over_off"]["all"] == pytest.approx([1.25, 1.0, 0.75])
    assert (s["off_output_tokens_per_s"], s["on_output_tokens_per_s"]) == (100, 98)
    assert s["on_worker_cpu_s_per_step"] == pytest.approx(5e-3)
    added = s["worker_cpu_us_per_step_added"]
    assert added["all"] == pytest.approx([1000.0, 0.0, -2000.0])
    assert (added["median"], added["min"], added["max"]) == pytest.approx((0.0, -2000.0, 1000.0))


def test_process_cpu_seconds_follow_os_times_and_grow_with_work():
    t0 = process_cpu_s(os.getpid())
    ref = os.times()
    assert abs(t0 - (ref.user + ref.system)) < 0.05   # clock ticks of /proc vs os.times
    end = time.process_time() + 0.2
    while time.process_time() < end:                  # burn 0.2 s of CPU
        pass
    assert process_cpu_s(os.getpid()) - t0 >= 0.15
    assert process_cpu_s(2 ** 22 + 12345) == 0.0      # no such process


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task"), reason="needs Linux /proc")
def test_tasks_cpu_seconds_count_every_thread_in_nanoseconds():
    """schedstat's run time agrees with the clock ticks and grows with a 0.2 s burn.

    The agreement is checked on a fresh child that burned 0.3 s and keeps its only thread: the
    clock ticks of ``/proc/PID/stat`` also count threads that have exited, schedstat only the
    live ones, so in the test process itself the two differ by the CPU time of every thread an
    earlier test ran (an engine's event loop, a worker pool): the check failed whenever such a
    test ran before this one in the same process."""
    child = subprocess.Popen([sys.executable, "-c", BURN_THEN_WAIT], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "burned\n"
        ticks, sched = process_cpu_s(child.pid), tasks_cpu_s(child.pid)
        assert ticks >= 0.25 and abs(sched - ticks) < 0.1, (sched, ticks)
    finally:
        child.kill()
        child.wait()
    t0 = tasks_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert 0.15 <= tasks_cpu_s(os.getpid()) - t0 < 1.0
    assert tasks_cpu_s(2 ** 22 + 12345) == 0.0


def test_split_cores_gives_disjoint_groups_or_none(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert split_cores(3) == [set(range(6)), set(range(6, 11)), set(range(11, 16))]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert split_cores(3) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_pin_sets_the_affinity_of_every_thread():
    before = os.sched_getaffinity(0)
    try:
        core = min(before)
        assert pin(os.getpid(), {core}) >= 1
        assert os.sched_getaffinity(0) == {core}
    finally:
        pin(os.getpid(), before)
    assert pin(2 ** 22 + 12345, before) == 0
