"""Scheduler: budgets, chunked prefill, cadence, in-flight limits, balanced admission, finishing."""

from collections import defaultdict

import numpy as np
import pytest

from ppstate.batch import StepResult
from ppstate.block_digest import digest_of
from ppstate.errors import SchedulerError
from ppstate.events import ListSink
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig


def spec(rid, plen=4, max_tokens=3, **kw):
    return RequestSpec(rid, tuple(range(10, 10 + plen)), max_tokens, **kw)


def answer(sched, token=7):
    """Return the oldest in-flight step's result: ``token`` for every sampling row."""
    out = sched.results.in_flight[0]
    n = out.num_rows
    res = StepResult(out.step, np.full((n, 1), token, dtype=np.int64),
                     out.is_final_chunk.astype(np.int32), np.zeros(n, dtype=np.int32))
    return sched.on_step_result(res)


def drive(sched, max_steps=500, token=7):
    """Issue steps while allowed, answer the oldest when blocked; returns all outputs."""
    outs = []
    while (sched.has_unfinished() or sched.in_flight) and len(outs) < max_steps:
        out = sched.schedule()
        if out is None:
            answer(sched, token)
        else:
            outs.append(out)
    last = sched.schedule()                              # delivers the last FreedSlots
    return outs + ([last] if last is not None else [])


def test_config_validation_names_field():
    with pytest.raises(SchedulerError, match="pp_size"):
        SchedulerConfig(pp_size=0)
    with pytest.raises(SchedulerError, match="max_model_len"):
        SchedulerConfig(max_model_len=1)
    with pytest.raises(SchedulerError, match="mode"):
        SchedulerConfig(mode="fast")
    c = SchedulerConfig(pp_size=4, max_num_seqs=64, max_num_batched_tokens=256)
    assert (c.in_flight_limit, c.cadence, c.max_rows_per_step, c.step_token_budget) == (5, 4, 16, 64)
    s = SchedulerConfig(pp_size=4, mode="sync")
    assert (s.in_flight_limit, s.cadence, s.max_rows_per_step, s.step_token_budget) == (1, 1, 64, 256)


def test_add_request_errors_and_max_tokens_cap():
    sched = Scheduler(SchedulerConfig(max_model_len=16))
    sched.add_request(spec("a", plen=10, max_tokens=100, sampling={"t": 0.5}))
    for bad, msg in ((spec("a"), "duplicate"), (RequestSpec("e", (), 3), "empty prompt"),
                     (spec("l", plen=16), "max_model_len"), (spec("m", max_tokens=0), "max_tokens")):
        with pytest.raises(SchedulerError, match=msg):
            sched.add_request(bad)
    out = sched.schedule()
    assert out.new_requests[0].max_seq_len == 16
    assert out.new_requests[0].sampling == {"t": 0.5}
    assert sched.state_of("a") == "decoding"
    with pytest.raises(SchedulerError, match="unknown request"):
        sched.state_of("zz")


def test_chunked_prefill_consecutive_steps():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_batched_tokens=256, max_prefill_chunk=32))
    sched.add_request(spec("a", plen=100, max_tokens=2))
    outs = [sched.schedule() for _ in range(3)]
    assert [o.step for o in outs] == [0, 1, 2]
    assert [o.num_scheduled_tokens.tolist() for o in outs] == [[32], [32], [32]]
    assert [o.start_positions.tolist() for o in outs] == [[0], [32], [64]]
    assert [o.is_final_chunk.tolist() for o in outs] == [[False]] * 3
    assert sched.state_of("a") == "prefilling"
    answer(sched)
    last = sched.schedule()
    assert (last.num_scheduled_tokens.tolist(), last.start_positions.tolist(),
            last.is_final_chunk.tolist()) == ([4], [96], [True])
    assert sched.state_of("a") == "decoding"


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_cadence_decode_rows_at_least_pp_apart(pp):
    sched = Scheduler(SchedulerConfig(pp_size=pp, max_num_seqs=8, max_prefill_chunk=8))
    for i in range(12):
        sched.add_request(spec(f"r{i}", plen=3 + 5 * (i % 4), max_tokens=6 + i % 5))
    sampled = defaultdict(list)
    for out in drive(sched):
        for rid, final in zip(out.req_ids, out.is_final_chunk):
            if final:
                sampled[rid].append(out.step)
    assert len(sampled) == 12
    gaps = [b - a for steps in sampled.values() for a, b in zip(steps, steps[1:])]
    assert min(gaps) == pp
    assert all(len(sampled[f"r{i}"]) == 6 + i % 5 for i in range(12))


def test_in_flight_limits_overlapped_and_sync():
    over = Scheduler(SchedulerConfig(pp_size=3))
    over.add_request(spec("a", max_tokens=50))
    outs = [over.schedule() for _ in range(2)]           # numbers 1, 2 carry nothing: skipped
    assert [(o.step, o.num_rows) for o in outs] == [(0, 1), (3, 1)]  # optimistic decode at 3
    # the window counts numbers: 0..3 are pp_size + 1 = 4, so step 4 waits although 2 are in flight
    assert over.schedule() is None and over.in_flight == 2 and over.next_step == 4
    answer(over)
    assert over.schedule().step == 6 and over.next_step == 7   # 4, 5 skipped: a's cadence
    sync = Scheduler(SchedulerConfig(pp_size=3, mode="sync"))
    sync.add_request(spec("a", max_tokens=50))
    assert sync.schedule().num_rows == 1 and sync.schedule() is None
    answer(sync)
    assert sync.schedule().start_positions.tolist() == [4]


def test_numbers_that_carry_nothing_are_skipped_not_used_up():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=1))
    sched.add_request(spec("a", max_tokens=2))
    sched.add_request(spec("b"))                         # waits: one slot
    assert [sched.schedule().step for _ in range(2)] == [0, 2]   # 1 carried nothing
    assert sched.schedule() is None and sched.next_step == 3     # window: 0..2 in flight
    answer(sched)                                        # a's first token
    # 3 and 4 would carry nothing (a has both its rows in flight, b no slot): None, 3 unused
    assert sched.schedule() is None and sched.next_step == 3 and sched.in_flight == 1
    answer(sched)                                        # a's last token frees its slot
    out = sched.schedule()
    assert (out.step, [f.req_id for f in out.freed], [n.req_id for n in out.new_requests]) == \
        (3, ["a"], ["b"])


def test_burst_spread_over_in_flight_batches():
    sched = Scheduler(SchedulerConfig(pp_size=4, max_num_seqs=64, max_num_batched_tokens=256))
    for i in range(64):
        sched.add_request(spec(f"r{i}", plen=4))
    outs = [sched.schedule() for _ in range(4)]
    assert [o.num_rows for o in outs] == [16, 16, 16, 16]
    assert [len(o.new_requests) for o in outs] == [16, 16, 16, 16]
    assert sched.num_waiting == 0 and sched.slots.num_free == 0
    fifth = sched.schedule()                              # lane of step 0 decodes again
    assert fifth.req_ids == outs[0].req_ids and fifth.num_scheduled_tokens.tolist() == [1] * 16


def test_lanes_rebalance_when_requests_finish():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=4))
    for i in range(4):
        sched.add_request(spec(f"r{i}", max_tokens=1 if i < 2 else 40))
    outs = drive(sched, max_steps=12)
    # r0, r1 finish at once: r2 and r3 (both in lane 1) spread over the two lanes.
    assert [o.req_ids for o in outs[:6]] == [("r0", "r1"), ("r2", "r3"), (), ("r2",), ("r3",),
                                              ("r2",)]


def test_finish_on_eos_stop_ids_and_length_frees_slots():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=4, mode="sync"))
    sched.add_request(spec("eos", max_tokens=9, eos_token_ids=frozenset({7})))
    sched.add_request(spec("ign", max_tokens=2, eos_token_ids=frozenset({7}), ignore_eos=True))
    sched.add_request(spec("stp", max_tokens=9, stop_token_ids=frozenset({7})))
    sched.schedule()
    ups = answer(sched)
    assert [(u.req_id, u.token_ids, u.finish_reason) for u in ups] == [
        ("eos", [7], "stop"), ("ign", [7], None), ("stp", [7], "stop")]
    out = sched.schedule()
    assert [(f.req_id, f.slot, f.reason) for f in out.freed] == [
        ("eos", 0, "finished_stopped"), ("stp", 2, "finished_stopped")]
    assert sched.state_of("eos") == "finished_stopped" and sched.slots.num_free == 3
    outs = [out] + drive(sched)
    assert sched.state_of("ign") == "finished_length"
    assert outs[-1].freed[0].req_id == "ign" and outs[-1].num_rows == 0


def test_optimistic_rows_after_eos_are_dropped():
    sched = Scheduler(SchedulerConfig(pp_size=2))
    sched.add_request(spec("a", max_tokens=20, eos_token_ids=frozenset({2})))
    outs = [sched.schedule() for _ in range(2)]          # steps 0 (final chunk), 2 (decode)
    assert [(o.step, o.num_rows) for o in outs] == [(0, 1), (2, 1)]   # 1 carried nothing
    assert [(u.token_ids, u.finish_reason) for u in answer(sched, token=2)] == [([2], "stop")]
    assert answer(sched) == []                           # optimistic decode of step 2 ignored
    assert sched.schedule().freed[0].req_id == "a" and not sched.has_unfinished()


def test_abort_waiting_running_unknown_and_stop():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=1))
    sched.add_request(spec("run", max_tokens=10))
    sched.add_request(spec("wait"))
    sched.add_request(spec("w2", max_tokens=10))
    sched.schedule()
    assert sched.abort("wait") and sched.state_of("wait") == "finished_aborted"
    assert sched.abort("run") and not sched.abort("run") and not sched.abort("nope")
    out = sched.schedule()                               # slot 0 reused at once
    assert [(f.req_id, f.slot) for f in out.freed] == [("run", 0)]
    assert [(n.req_id, n.slot) for n in out.new_requests] == [("w2", 0)]
    assert sched.stop("w2") is True and sched.state_of("w2") == "finished_stopped"
    sched.add_request(spec("p", plen=100))
    assert sched.stop("p") is False                      # waiting: no stop edge


def test_result_order_and_row_count_checked():
    sched = Scheduler(SchedulerConfig(pp_size=2))
    sched.add_request(spec("a"))
    out = sched.schedule()
    bad = StepResult(5, np.zeros((1, 1), np.int64), np.ones(1, np.int32), np.zeros(1, np.int32))
    with pytest.raises(SchedulerError, match="out of order"):
        sched.on_step_result(bad)
    short = StepResult(out.step, np.zeros((0, 1), np.int64), np.zeros(0, np.int32),
                       np.zeros(0, np.int32))
    with pytest.raises(SchedulerError, match="rows"):
        sched.on_step_result(short)


def test_events_and_nothing_to_do():
    sink = ListSink()
    sched = Scheduler(SchedulerConfig(pp_size=2), sink=sink)
    assert sched.schedule() is None
    sched.add_request(spec("a", max_tokens=1))
    drive(sched)
    edges = [(e.data["req_id"], e.data["trigger"], e.data["state"]) for e in sink.of_kind("lifecycle")]
    assert edges == [("a", "admit", "prefilling"), ("a", "complete_prefill", "decoding"),
                     ("a", "hit_length", "finished_length")]
    assert [e.step for e in sink.of_kind("schedule")] == [0, 1]
    assert sched.schedule() is None


def test_output_array_dtypes_and_schedule_event_payload():
    """The SchedulerOutput contract ([num_rows] int32 / bool arrays) and the exact trace event."""
    sink = ListSink()
    sched = Scheduler(SchedulerConfig(pp_size=2, max_prefill_chunk=4), sink=sink)
    sched.add_request(spec("a", plen=6))
    out = sched.schedule()
    assert (out.slots.dtype, out.num_scheduled_tokens.dtype, out.start_positions.dtype,
            out.is_final_chunk.dtype) == (np.int32, np.int32, np.int32, np.bool_)
    assert sched.slots.generation.dtype == np.int64
    ev = sink.of_kind("schedule")[0]
    # trace format v1 (docs/trace_format.md): every SchedulerOutput field; prompt ids as a length
    assert (ev.step, ev.data) == (0, {"output": {
        "step": 0, "req_ids": ["a"], "slots": [0], "num_scheduled_tokens": [4],
        "start_positions": [0], "is_final_chunk": [False],
        "new_requests": [{"req_id": "a", "slot": 0, "prompt_len": 6, "max_seq_len": 9,
                          "sampling": {}, "num_cached_tokens": 0, "num_output_tokens": 0}],
        "freed": [],
        # one 16-token KV block (block 0) for the 4 scheduled tokens of slot 0
        "block_table_slots": [0], "block_table_cols": [0], "block_table_ids": [0],
        # the row's block ids [0] digested: 1 * W_0 + 0 * W_1 (ppstate/block_digest.py)
        "block_digests": [digest_of([0])]}})
    assert [e.step for e in sink.of_kind("lifecycle")] == [0]
    assert out.block_digests.dtype == np.int64 and digest_of([0]) == _w0()


def _w0() -> int:
    """W_0 written out: splitmix64(0) | 1, as int64 (an independent statement of the digest)."""
    x = 0x9E3779B97F4A7C15
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    x = (x ^ (x >> 31)) | 1
    return x - 2**64 if x >= 2**63 else x


def test_row_cap_is_the_ceiling_of_the_live_share():
    sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=8))
    for rid in "abc":
        sched.add_request(spec(rid))
    assert sched.row_cap() == 2 and isinstance(sched.row_cap(), int)  # ceil(3 / 2)


def test_out_of_order_result_names_the_expected_step():
    sched = Scheduler(SchedulerConfig(pp_size=2))
    sched.add_request(spec("a"))
    sched.schedule()
    bad = StepResult(5, np.zeros((1, 1), np.int64), np.ones(1, np.int32), np.zeros(1, np.int32))
    with pytest.raises(SchedulerError, match=r"step result 5 out of order \(expected 0\)"):
        sched.on_step_result(bad)


def test_final_row_with_no_sample_gives_no_update_and_two_tokens_are_both_taken():
    """``num_sampled`` is authoritative: 0 gives no update; 2 (speculative width) appends both."""
    sched = Scheduler(SchedulerConfig(pp_size=1, mode="sync"))
    sched.add_request(spec("a", max_tokens=5))
    out = sched.schedule()
    assert out.is_final_chunk.tolist() == [True]
    none = StepResult(out.step, np.zeros((1, 2), np.int64), np.zeros(1, np.int32),
                      np.zeros(1, np.int32))
    assert sched.on_step_result(none) == []
    out = sched.schedule()
    two = StepResult(out.step, np.array([[7, 8]], np.int64), np.array([2], np.int32),
                     np.zeros(1, np.int32))
    [upd] = sched.on_step_result(two)
    assert (upd.token_ids, upd.finish_reason) == ([7, 8], None)
    assert sched.state_of("a") == "decoding"


def test_finished_request_leaves_the_lifecycle_machine():
    sched = Scheduler(SchedulerConfig(pp_size=2))
    sched.add_request(spec("a", max_tokens=1))
    drive(sched)
    assert sched.state_of("a") == "finished_length"
    assert all(getattr(m, "req_id", None) != "a" for m in sched.lifecycle.machine.models)


def test_last_budget_token_goes_to_a_continuing_prefill():
    """With one token of step budget left after decodes, a prefilling request still gets a
    one-token chunk (budget 2: one decode row + one prefill token)."""
    sched = Scheduler(SchedulerConfig(pp_size=1, mode="sync", max_num_batched_tokens=2,
                                      max_prefill_chunk=4, max_num_seqs=4))
    sched.add_request(spec("d", plen=1, max_tokens=5))
    sched.add_request(spec("a", plen=5))
    first = sched.schedule()
    assert list(zip(first.req_ids, first.num_scheduled_tokens.tolist())) == [("d", 1), ("a", 1)]
    answer(sched)
    nxt = sched.schedule()
    assert list(zip(nxt.req_ids, nxt.num_scheduled_tokens.tolist(), nxt.start_positions.tolist())) \
        == [("d", 1, 1), ("a", 1, 1)]


def test_result_with_nothing_in_flight_is_a_scheduler_error():
    sched = Scheduler(SchedulerConfig(pp_size=2))
    res = StepResult(0, np.zeros((0, 1), np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))
    with pytest.raises(SchedulerError, match=r"out of order \(expected None\)"):
        sched.on_step_result(res)
