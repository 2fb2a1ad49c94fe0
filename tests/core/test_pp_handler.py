"""PPHandler FIFO: need-sampled mask, broadcast skip, deferred consume, generation check."""

import numpy as np
import pytest

from ppstate.batch import SchedulerOutput
from ppstate.errors import PPStateError, SlotError
from ppstate.events import ListSink
from ppstate.pp_handler import PPHandler, need_sampled_mask, should_broadcast


def out(step, slots, final):
    n = len(slots)
    return SchedulerOutput(step, tuple(f"r{s}" for s in slots), np.array(slots, dtype=np.int32),
                           np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int32),
                           np.array(final, dtype=bool))


def step(h, o, handle=None):
    got = h.consume()
    h.enqueue(o.step, o, need_sampled_mask(o), handle)
    return got


def test_mask_none_for_empty_and_all_non_final_chunks():
    assert need_sampled_mask(SchedulerOutput.empty(0)) is None
    assert need_sampled_mask(out(1, [0, 1], [False, False])) is None
    assert not should_broadcast(out(1, [0, 1], [False, False]))
    m = need_sampled_mask(out(2, [0, 1, 2], [False, True, True]))
    assert m.tolist() == [False, True, True]
    assert should_broadcast(out(2, [0], [True]))


def test_consume_returns_entry_posted_depth_steps_earlier():
    h = PPHandler(depth=3, max_num_reqs=4)
    got = [step(h, out(s, [s % 4], [True]), handle=f"h{s}") for s in range(6)]
    assert got[:3] == [None, None, None]
    assert [g.step for g in got[3:]] == [0, 1, 2]
    assert [g.handle for g in got[3:]] == ["h0", "h1", "h2"]
    assert got[3].idx_mapping.tolist() == [0]
    assert got[5].idx_mapping.dtype == np.int64
    assert len(h) == 3 and h.pending_steps() == [3, 4, 5]


def test_rows_not_needing_sample_become_minus_one():
    h = PPHandler(depth=1, max_num_reqs=8)
    step(h, out(0, [5, 6, 7], [True, False, True]))
    got = h.consume()
    assert got.idx_mapping.tolist() == [5, -1, 7]
    assert got.mask.tolist() == [True, False, True]


def test_all_non_final_chunk_step_posts_nothing_and_consumes_none():
    h = PPHandler(depth=2, max_num_reqs=4)
    step(h, out(0, [0, 1], [False, False]))
    step(h, out(1, [0], [True]))
    assert h.pending_steps() == [1]
    assert step(h, out(2, [2], [True])) is None      # step 0 had no entry
    assert step(h, out(3, [2], [True])).step == 1


def test_freed_slot_rows_are_stale():
    sink = ListSink()
    h = PPHandler(depth=2, max_num_reqs=4, sink=sink, rank=0)
    step(h, out(0, [1, 2], [True, True]))
    h.on_slot_freed(1)
    assert h.generation.tolist() == [0, 1, 0, 0]
    step(h, out(1, [1], [True]))                     # slot 1 reused by a new request
    got = h.consume()
    assert got.step == 0 and got.idx_mapping.tolist() == [-1, 2]
    h.enqueue(2, out(2, [3], [True]), np.array([True]))
    assert h.consume().idx_mapping.tolist() == [1]  # step 1 saw the new generation
    kinds = [e.kind for e in sink.events]
    assert kinds.count("pp.free") == 1 and kinds.count("pp.consume") == 2


def test_all_rows_stale_returns_none_but_waits_on_handle():
    class Handle:
        waited = 0

        def wait(self):
            Handle.waited += 1

    h = PPHandler(depth=1, max_num_reqs=2)
    step(h, out(0, [0], [True]), handle=Handle())
    h.on_slot_freed(0)
    assert h.consume() is None
    assert Handle.waited == 1


def test_stale_check_is_per_slot_and_survives_repeated_reuse():
    """Only rows of freed slots go stale; a slot freed and reused twice (A -> B -> C) between
    enqueue and consume is still stale; rows enqueued after the frees are applied."""
    h = PPHandler(depth=3, max_num_reqs=4)
    step(h, out(0, [0, 1, 2], [True, True, True]))   # A on 0, others on 1, 2
    h.on_slot_freed(0)                               # A gone, B takes slot 0
    step(h, out(1, [0, 3], [True, True]))
    h.on_slot_freed(0)                               # B gone, C takes slot 0
    step(h, out(2, [0], [True]))
    assert h.consume().idx_mapping.tolist() == [-1, 1, 2]   # step 0: only slot 0's row dropped
    h.enqueue(3, out(3, [1], [True]), np.array([True]))
    assert h.consume().idx_mapping.tolist() == [-1, 3]      # step 1: B's row dropped too
    h.enqueue(4, out(4, [2], [True]), np.array([True]))
    assert h.consume().idx_mapping.tolist() == [0]          # step 2: C's row is current
    h.enqueue(5, out(5, [2], [True]), np.array([True]))
    h.on_slot_freed(2)                                      # after steps 4 and 5 were enqueued
    assert h.consume().idx_mapping.tolist() == [1]          # step 3: slot 1 untouched
    h.enqueue(6, out(6, [3], [True]), np.array([True]))
    assert h.consume() is None                              # step 4: its only row is stale
    assert h.generation.tolist() == [2, 0, 1, 0]


def test_push_empty_and_call_order_errors():
    h = PPHandler(depth=1, max_num_reqs=2)
    with pytest.raises(PPStateError, match="enqueue without consume"):
        h.push_empty(0)
    assert h.consume() is None
    h.push_empty(0)
    assert h.consume() is None
    with pytest.raises(PPStateError, match="consume twice"):
        h.consume()
    with pytest.raises(SlotError):
        PPHandler(depth=0, max_num_reqs=2)


def test_events_carry_rank_step_slot_generation_and_idx_mapping():
    sink = ListSink()
    h = PPHandler(depth=1, max_num_reqs=4, sink=sink, rank=1)
    step(h, out(3, [2, 0], [True, False]))
    h.on_slot_freed(2)
    h.consume()
    h.push_empty(4)
    got = [(e.kind, e.step, e.rank, e.data) for e in sink.events]
    assert got == [("pp.enqueue", 3, 1, {"pending": True}),
                   ("pp.free", -1, 1, {"slot": 2, "generation": 1}),
                   ("pp.consume", 3, 1, {"idx_mapping": [-1, -1], "dropped": 1}),
                   ("pp.enqueue", 4, 1, {"pending": False})]
    assert h.num_dropped == 1   # the stale row of slot 2; slot 0's row needed no sample
    assert h.generation.dtype == np.int64
    m = need_sampled_mask(out(5, [1], [True]))
    assert m.dtype == np.bool_


def test_bad_sizes_message_names_both_values():
    with pytest.raises(SlotError, match=r"depth >= 1 and max_num_reqs >= 1, got 0, 2"):
        PPHandler(depth=0, max_num_reqs=2)
