"""Scheduler with KV blocks: exact block-table deltas, prefix hits, recompute preemption, stale
rows of a preempted admission, capacity errors; pool invariants after every step."""

from __future__ import annotations

import numpy as np
import pytest

from ppstate.batch import StepResult
from ppstate.errors import SchedulerError
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig


def sync_cfg(**kw):
    base = dict(pp_size=1, mode="sync", max_num_seqs=4, max_num_batched_tokens=64,
                max_prefill_chunk=64, max_model_len=64, block_size=4, num_kv_blocks=16)
    base.update(kw)
    return SchedulerConfig(**base)


def answer(sched, tokens):
    """Answer the oldest in-flight step: row i samples ``tokens[i]`` (sampling rows only)."""
    out = sched.results.in_flight[0]
    ids = np.asarray(tokens[:out.num_rows] if out.num_rows else [], dtype=np.int64).reshape(-1, 1)
    return sched.on_step_result(StepResult(out.step, ids, out.is_final_chunk.astype(np.int32),
                                           np.zeros(out.num_rows, dtype=np.int32)))


def deltas(out):
    return list(zip(out.block_table_slots.tolist(), out.block_table_cols.tolist(),
                    out.block_table_ids.tolist()))


def test_deltas_and_prefix_hit_start_at_first_uncached_token():
    s = Scheduler(sync_cfg())
    a = tuple(range(100, 110))                       # 10 tokens: blocks [0..3][4..7] full, [8, 9]
    s.add_request(RequestSpec("a", a, 2))
    out = s.schedule()
    assert deltas(out) == [(0, 0, 0), (0, 1, 1), (0, 2, 2)]
    assert out.start_positions.tolist() == [0] and out.num_scheduled_tokens.tolist() == [10]
    answer(s, [5])
    s.add_request(RequestSpec("b", a[:8] + (7, 7, 7), 2))  # shares the two full blocks
    out = s.schedule()                                # a's decode row, b's first chunk
    assert out.req_ids == ("a", "b")
    assert out.new_requests[0].num_cached_tokens == 8
    assert out.start_positions.tolist() == [10, 8] and out.num_scheduled_tokens.tolist() == [1, 3]
    assert deltas(out) == [(1, 0, 0), (1, 1, 1), (1, 2, 3)]
    assert s.kv.pool.ref_count[:4].tolist() == [2, 2, 1, 1]
    s.kv.pool.check_invariants()
    assert s.kv_stats()["prefix_cache_hit_tokens"] == 8 and s.num_prefill_tokens == 13


def test_preemption_recomputes_youngest_with_its_tokens_and_frees_every_block():
    # 4 blocks of 2 tokens; a and b (3-token prompts, 4 new tokens) cannot both finish.
    s = Scheduler(sync_cfg(block_size=2, num_kv_blocks=4, max_model_len=16))
    s.add_request(RequestSpec("a", (1, 2, 3), 4))
    s.add_request(RequestSpec("b", (4, 5, 6), 4))
    outs, tok, got = [], iter(range(50, 100)), {"a": [], "b": []}
    while s.has_unfinished() or s.in_flight:
        out = s.schedule()
        if out is None:
            for u in answer(s, [next(tok) for _ in range(8)]):
                got[u.req_id] += u.token_ids
            continue
        outs.append(out)
        s.kv.pool.check_invariants()
    preempted = [(o.step, f.req_id, f.slot) for o in outs for f in o.freed if f.reason == "preempted"]
    assert preempted == [(2, "b", 1)]              # step 2: a's decode at position 4 needs block 3
    readmit = [n for o in outs for n in o.new_requests if n.req_id == "b"][1]
    assert readmit.num_output_tokens == 2          # sampled at steps 0 and 1, kept
    assert readmit.prompt_token_ids == (4, 5, 6) + tuple(got["b"][:2])
    assert readmit.num_cached_tokens == 2          # its own first block, still cached
    assert len(got["a"]) == len(got["b"]) == 4
    assert s.state_of("a") == s.state_of("b") == "finished_length"
    assert s.num_preemptions == 1 and s.kv.pool.tables == {}
    assert s.kv.pool.num_free == 4


def test_rows_of_a_preempted_admission_are_dropped():
    s = Scheduler(sync_cfg(pp_size=2, mode="overlapped"))
    s.add_request(RequestSpec("a", (1, 2, 3), 5))
    first = s.schedule()                             # a's prefill, result not yet back
    req = s.queues.running["a"]
    s.preempt(req)
    again = s.schedule()                             # re-admitted at once (fresh epoch)
    assert [n.req_id for n in again.new_requests] == ["a"] and req.epoch == 2
    assert [f.reason for f in again.freed] == ["preempted"]
    assert answer(s, [99]) == []                     # step 0's token belongs to the old admission
    assert req.output_token_ids == [] and first.step == 0
    upd = answer(s, [42])
    assert [(u.req_id, u.token_ids) for u in upd] == [("a", [42])]


def test_request_that_can_never_fit_is_refused_naming_both_lengths():
    s = Scheduler(sync_cfg(block_size=4, num_kv_blocks=3))   # 12 tokens
    with pytest.raises(SchedulerError, match=r"prompt of 5 tokens \+ max_tokens 9 needs KV cache "
                                             r"for 13 tokens; the cache holds 12"):
        s.add_request(RequestSpec("x", (1,) * 5, 9))
    s.add_request(RequestSpec("y", (1,) * 5, 8))


def test_prefix_caching_on_hits_after_the_owner_finished():
    s = Scheduler(sync_cfg())
    s.add_request(RequestSpec("a", tuple(range(9)), 1))
    s.schedule()
    answer(s, [3])
    assert s.kv.pool.num_cached == 2                 # two full blocks kept, the partial one freed
    s.add_request(RequestSpec("b", tuple(range(9)), 1))
    out = s.schedule()
    assert out.new_requests[0].num_cached_tokens == 8 and out.start_positions.tolist() == [8]
    assert [f.reason for f in out.freed] == ["finished_length"]


def test_prefix_caching_off_never_hits():
    s = Scheduler(sync_cfg(enable_prefix_caching=False))
    s.add_request(RequestSpec("a", tuple(range(9)), 1))
    s.schedule()
    answer(s, [3])                                   # a finished: its blocks are released
    assert s.kv.pool.num_cached == 0 and s.kv.pool.num_free == 16
    s.add_request(RequestSpec("b", tuple(range(9)), 1))
    out = s.schedule()
    assert out.new_requests[0].num_cached_tokens == 0 and out.start_positions.tolist() == [0]
