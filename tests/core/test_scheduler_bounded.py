"""Scheduler memory stays bounded over many requests, and finished ids may be used again.

Issue #12: ``_finished`` kept every id forever; re-adding a finished or aborted id raised
``duplicate request id``. vLLM rejects duplicates of live ids only; so does ppstate now.
"""

import pytest

from ppstate.errors import SchedulerError
from ppstate.scheduler import FINISHED_HISTORY, Scheduler, SchedulerConfig
from test_scheduler import answer, drive, spec


def internal_sizes(sched: Scheduler) -> dict[str, int]:
    """Sizes of every per-request map of the scheduler."""
    return {"finished": len(sched.queues.finished), "live": len(sched.queues.live),
            "running": len(sched.queues.running), "waiting": len(sched.queues.waiting),
            "slot_of": len(sched.slots._slot_of), "kv_tables": len(sched.kv.pool.tables),
            "in_flight": len(sched.results.in_flight), "freed": len(sched.queues.freed)}


def test_internal_maps_bounded_after_many_requests():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=8, max_model_len=64))
    n = 3 * FINISHED_HISTORY
    for i in range(n):
        sched.add_request(spec(f"r{i}", plen=3, max_tokens=2))
        if i % 7 == 3:
            sched.abort(f"r{i - 1}")  # some aborted too (maybe already finished: False)
        if i % 16 == 15:
            drive(sched)
    drive(sched)
    sizes = internal_sizes(sched)
    assert sizes == {"finished": FINISHED_HISTORY, "live": 0, "running": 0, "waiting": 0,
                     "slot_of": 0, "kv_tables": 0, "in_flight": 0, "freed": 0}
    assert sched.slots.num_free == 8
    # the most recent finished ids still answer state_of, the oldest are forgotten
    assert sched.state_of(f"r{n - 1}") == "finished_length"
    with pytest.raises(SchedulerError, match="unknown request"):
        sched.state_of("r0")


@pytest.mark.parametrize("how", ["finished", "aborted_waiting", "aborted_running"])
def test_reuse_of_finished_id_is_served_anew(how):
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=4, max_model_len=64))
    sched.add_request(spec("a", plen=3, max_tokens=2))
    if how == "finished":
        drive(sched, token=5)
        assert sched.state_of("a") == "finished_length"
    elif how == "aborted_waiting":
        assert sched.abort("a")
    else:
        sched.schedule()                                  # admitted, prefill row in flight
        assert sched.state_of("a") == "decoding" and sched.abort("a")  # final chunk issued
    assert sched.state_of("a") in ("finished_length", "finished_aborted")
    sched.add_request(spec("a", plen=5, max_tokens=3))    # same id again: accepted
    assert sched.state_of("a") == "waiting"
    with pytest.raises(SchedulerError, match="live"):    # a live id stays rejected
        sched.add_request(spec("a"))
    got = []
    while sched.has_unfinished() or sched.in_flight:
        out = sched.schedule()
        if out is None:
            got += [t for u in answer(sched, token=9) for t in u.token_ids]
    assert got == [9, 9, 9] and sched.state_of("a") == "finished_length"
    assert sched.slots.num_free == 4


def test_stale_rows_of_a_reused_id_are_ignored():
    """The earlier request's optimistic decode rows are still in flight when the id comes back
    and is admitted; their results must not count for the new request."""
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=4, max_model_len=64))
    sched.add_request(spec("a", plen=3, max_tokens=10))
    outs = [sched.schedule() for _ in range(2)]           # prefill (final chunk), decode
    assert [(o.step, o.req_ids) for o in outs] == [(0, ("a",)), (2, ("a",))]  # 1: nothing
    assert sched.abort("a")
    sched.add_request(spec("a", plen=3, max_tokens=2))
    assert sched.schedule() is None                       # window: numbers 0..2 in flight
    assert answer(sched, token=4) == []                   # the old prefill's result: dropped
    new = sched.schedule()                                # admitted behind the stale decode row
    assert new.step == 3 and "a" in new.req_ids and new.freed[0].req_id == "a"
    assert answer(sched, token=4) == []                   # the stale decode row: dropped
    ups = answer(sched, token=6)                          # the new admission's prefill
    assert [(u.req_id, u.token_ids) for u in ups] == [("a", [6])]
    got = [6]
    while sched.has_unfinished() or sched.in_flight:
        if sched.schedule() is None:
            got += [t for u in answer(sched, token=6) for t in u.token_ids]
    assert got == [6, 6] and sched.slots.num_free == 4
