"""The one step order (ppstate.rank_step) over a recording backend, and the payload view."""

import numpy as np
import pytest

from ppstate.batch import NewRequest, SchedulerOutput, StepResult
from ppstate.errors import PPStateError
from ppstate.events import ListSink
from ppstate.payload import SampledPayload
from ppstate.rank_step import RankStep


def _out(step, slots, num_scheduled_tokens, final, new=()):
    n = len(slots)
    return SchedulerOutput(step, tuple(f"r{s}" for s in slots), np.array(slots, dtype=np.int32),
                           np.array(num_scheduled_tokens, dtype=np.int32), np.zeros(n, dtype=np.int32),
                           np.array(final, dtype=bool), new_requests=tuple(new))


class Recorder:
    """A backend that logs each call and applies payloads to a per-slot counter."""

    def __init__(self):
        self.calls, self.computed = [], np.zeros(4, dtype=np.int64)

    def __getattr__(self, name):
        def op(out, *args):
            self.calls.append(name)
        return op

    def apply_scheduled(self, out):
        self.calls.append("apply_scheduled")
        np.add.at(self.computed, out.slots.astype(np.int64), out.num_scheduled_tokens)

    def sample(self, out, mask, logits):
        self.calls.append("sample")
        p = SampledPayload.zeros(out.num_rows)
        p.token_ids[:, 0], p.num_sampled[:] = 7, np.asarray(mask, dtype=np.int64)
        p.num_rejected[:] = 1          # as if one draft token was rejected per row
        return p

    def apply_sampled(self, step, idx, payload):
        self.calls.append(f"apply_sampled@{step}")
        live = idx >= 0
        np.subtract.at(self.computed, idx[live], np.asarray(payload.num_rejected)[live])

    def post_receive(self, out, mask):
        self.calls.append("post_receive")
        return out.step

    def received(self, entry):
        self.calls.append("received")
        p = SampledPayload.zeros(len(entry.idx_mapping))
        p.num_rejected[:] = 2
        return p

    def result(self, out, payload):
        self.calls.append("result")
        return StepResult(out.step, payload.token_ids.copy(), payload.num_sampled, payload.num_rejected)


def test_last_rank_order_and_rejected_applied_after_sampling():
    b = Recorder()
    rs = RankStep(b, rank=1, pp_size=2, depth=2, max_num_reqs=4)
    res = rs.step(_out(0, [0, 1], [3, 5], [True, False]))
    assert rs.handler is None
    assert b.calls == ["begin_step", "free_and_admit", "prepare_inputs", "receive", "forward",
                       "apply_scheduled", "sample", "apply_sampled@0", "publish", "result",
                       "end_step"]
    assert b.computed.tolist() == [2, 5, 0, 0]     # row 0 sampled: 3 computed - 1 rejected
    assert res.sampled_token_ids[:, 0].tolist() == [7, 7]


def test_non_last_rank_defers_the_payload_by_depth_steps():
    b = Recorder()
    rs = RankStep(b, rank=0, pp_size=2, depth=2, max_num_reqs=4)
    new = [NewRequest("r0", 0, (1, 2, 3), 8)]
    rs.step(_out(0, [0], [3], [True], new))
    assert b.calls == ["begin_step", "free_and_admit", "prepare_inputs", "forward", "send",
                       "apply_scheduled", "post_receive", "end_step"]
    assert rs.handler.pending_steps() == [0]
    rs.step(_out(1, [], [], []))                   # empty step: nothing consumed yet (depth 2)
    assert "apply_sampled@0" not in b.calls
    assert b.calls[-2:] == ["skip_receive", "end_step"]
    b.calls.clear()
    rs.step(_out(2, [0], [1], [True]))
    assert b.calls[:3] == ["begin_step", "received", "apply_sampled@0"]
    assert b.computed[0] == 3 - 2 + 1              # deferred num_rejected taken back at step 2


def test_skipped_numbers_turn_the_fifo_over_as_empty_steps():
    b, sink = Recorder(), ListSink()
    rs = RankStep(b, rank=0, pp_size=2, depth=2, max_num_reqs=4, sink=sink)
    rs.step(_out(0, [0], [3], [True], [NewRequest("r0", 0, (1, 2, 3), 8)]))
    b.calls.clear()
    rs.step(_out(3, [0], [1], [True]))             # numbers 1 and 2 carried nothing
    # skipped 1 consumes the (empty) entry of -1, skipped 2 the pending one of step 0, step 3
    # its own of 1 (empty): the payload of 0 is applied before anything of step 3 runs
    assert b.calls[:4] == ["begin_step", "received", "apply_sampled@0", "free_and_admit"]
    assert b.calls.count("apply_sampled@0") == 1 and rs.next_step == 4
    assert rs.handler.pending_steps() == [3] and len(rs.handler) == 2
    assert [(e.step, e.data["pending"]) for e in sink.of_kind("pp.enqueue")] == \
        [(0, True), (1, False), (2, False), (3, True)]
    with pytest.raises(PPStateError, match="step 2 after step 3"):
        rs.step(_out(2, [0], [1], [True]))


def test_payload_view_writes_through_and_checks_shape():
    p = SampledPayload.zeros(3, width=2)
    assert p.buf.shape == SampledPayload.shape(3, 2) == (3, 4)
    p.token_ids[1] = [5, 6]
    p.num_sampled[1], p.num_rejected[1] = 2, 1
    assert p.buf[1].tolist() == [5, 6, 2, 1]
    with pytest.raises(ValueError, match="width"):
        SampledPayload(np.zeros((3, 2), dtype=np.int64))
