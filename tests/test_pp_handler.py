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


def test_generation_check_switch_off_applies_stale_row(monkeypatch):
    monkeypatch.setattr(PPHandler, "_stale_rows",
                        lambda self, e: np.zeros(len(e.idx_mapping), dtype=bool))
    h = PPHandler(depth=1, max_num_reqs=2)
    step(h, out(0, [0], [True]))
    h.on_slot_freed(0)
    assert h.consume().idx_mapping.tolist() == [0]


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
