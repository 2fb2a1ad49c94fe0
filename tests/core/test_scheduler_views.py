"""The scheduler's slot-indexed views (issue #11: decode rows and results with array operations):
``slot_epoch`` / ``decoding`` / ``slot_req`` / ``out_tokens`` and ``KVManager.held`` agree with the
running requests, the block tables and the tokens delivered after every step, through preemption,
aborts, EOS and slot reuse; the two decode paths (all rows at once, and row by row when blocks run short) give the
exact rows; :class:`StepUpdates` reads as the list of TokenUpdates it stands for."""

from __future__ import annotations

import random

import numpy as np

from ppstate.batch import StepResult
from ppstate.request import TokenUpdate
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from ppstate.step_updates import StepUpdates, count_tokens

EOS = 2


def check_views(s: Scheduler, delivered: dict[str, list[int]] | None = None) -> None:
    """Every view equals what the running requests and the block pool say; with ``delivered``
    (request id -> every token delivered to it) the output rows hold exactly those tokens."""
    running = {r.slot: r for r in s.running_requests()}
    for slot in range(s.config.max_num_seqs):
        req = running.get(slot)
        if req is None:
            assert s.views.slot_epoch[slot] == 0 and not s.views.decoding[slot]
            assert s.views.slot_req[slot] is None
            assert not s.views.out_tokens[slot].any() and s.kv.held[slot] == 0
            continue
        assert s.views.slot_epoch[slot] == req.epoch and s.views.slot_req[slot] is req
        assert bool(s.views.decoding[slot]) == (req.state == "decoding")
        n = int(s.arrays.num_output_tokens[slot])
        assert not s.views.out_tokens[slot, n:].any()
        assert s.views.out_tokens[slot, :len(req.output_token_ids)].tolist() == req.output_token_ids
        if delivered is not None:
            assert s.views.out_tokens[slot, :n].tolist() == delivered.get(req.req_id, [])
        assert s.kv.held[slot] == len(s.kv.pool.table(req.req_id))


def drive(cfg: SchedulerConfig, seed: int, n: int = 24) -> tuple[list, list, int]:
    """Random arrivals, aborts and EOS tokens; returns every output (rows), every update and
    the number of preemptions."""
    rng = random.Random(seed)
    s = Scheduler(cfg)
    outs, updates, added, delivered, reqs = [], [], 0, {}, {}
    while added < n or s.has_unfinished() or s.in_flight:
        if added < n and rng.random() < 0.5:
            plen = rng.randint(1, 6)
            s.add_request(RequestSpec(f"r{added}", tuple(rng.randrange(3, 50) for _ in range(plen)),
                                      rng.randint(1, 6), eos_token_ids=frozenset({EOS})))
            reqs[f"r{added}"] = s.queues.live[f"r{added}"]
            added += 1
        if added and rng.random() < 0.05:
            s.abort(f"r{rng.randrange(added)}")
        out = s.schedule()
        if out is not None:
            outs.append((out.req_ids, out.slots.tolist(), out.start_positions.tolist(),
                         out.num_scheduled_tokens.tolist()))
        if s.in_flight and (out is None or s.in_flight >= cfg.in_flight_limit):
            o = s.results.in_flight[0]
            toks = [EOS if rng.random() < 0.1 else rng.randrange(3, 50) for _ in range(o.num_rows)]
            res = StepResult(o.step, np.array(toks, dtype=np.int64).reshape(-1, 1),
                             o.is_final_chunk.astype(np.int32), np.zeros(o.num_rows, np.int32))
            updates.append([(u.req_id, u.token_ids, u.finish_reason) for u in s.on_step_result(res)])
            for rid, toks, _ in updates[-1]:
                delivered.setdefault(rid, []).extend(toks)
        check_views(s, delivered)
        s.kv.pool.check_invariants()
    for rid, req in reqs.items():   # every request left its slot: its list has all its tokens
        assert req.output_token_ids == delivered.get(rid, [])
    return outs, updates, s.num_preemptions


def test_views_follow_the_running_requests_through_preemption_and_aborts():
    for seed in range(6):
        cfg = SchedulerConfig(pp_size=2, max_num_seqs=4, max_num_batched_tokens=16,
                              max_prefill_chunk=4, max_model_len=32, block_size=2,
                              num_kv_blocks=(8, 40)[seed % 2])  # tight: preemption on decode rows
        outs, updates, preemptions = drive(cfg, seed)
        assert outs and any(updates) and (preemptions > 0) == (seed % 2 == 0)
        assert outs == drive(cfg, seed)[0]                         # deterministic


def test_short_of_blocks_decode_rows_preempt_the_youngest_in_order():
    # 2 slots, 3 blocks of 1 token: after both prompts (1 token each) every decode row needs a
    # new block; the second one finds none and preempts the younger request (itself).
    cfg = SchedulerConfig(pp_size=1, mode="sync", max_num_seqs=2, max_num_batched_tokens=8,
                          max_prefill_chunk=8, max_model_len=8, block_size=1, num_kv_blocks=3)
    s = Scheduler(cfg)
    s.add_request(RequestSpec("a", (5,), 3))
    s.add_request(RequestSpec("b", (6,), 3))
    out = s.schedule()
    assert out.req_ids == ("a", "b")
    s.on_step_result(StepResult(out.step, np.array([[7], [8]]), np.ones(2, np.int32),
                                np.zeros(2, np.int32)))
    out = s.schedule()                       # a gets block 2; b has none left: b is preempted
    assert out.req_ids == ("a",) and out.start_positions.tolist() == [1]
    assert [f.req_id for f in out.freed] == ["b"] and s.state_of("b") == "waiting"
    check_views(s)


def test_step_updates_read_as_token_updates():
    upd = StepUpdates(("a", "b", "c"), [4, 5, 6], {1: "stop"})
    want = [TokenUpdate("a", [4], None), TokenUpdate("b", [5], "stop"), TokenUpdate("c", [6], None)]
    assert upd == want and list(upd) == want and upd[-1] == want[2] and upd[1:] == want[1:]
    assert len(upd) == 3 and count_tokens(upd) == 3 and count_tokens(want) == 3
    assert StepUpdates((), [], {}) == [] and upd != want[:2]


def test_one_token_results_finish_on_eos_and_length_with_exact_updates():
    s = Scheduler(SchedulerConfig(pp_size=1, mode="sync", max_num_seqs=3,
                                  max_num_batched_tokens=16, max_model_len=16))
    s.add_request(RequestSpec("a", (5, 6), 1))
    s.add_request(RequestSpec("b", (5, 7), 3, eos_token_ids=frozenset({EOS})))
    s.add_request(RequestSpec("c", (5, 8), 3, eos_token_ids=frozenset({EOS}), ignore_eos=True))
    out = s.schedule()
    got = s.on_step_result(StepResult(out.step, np.array([[9], [EOS], [EOS]]),
                                      np.ones(3, np.int32), np.zeros(3, np.int32)))
    assert isinstance(got, StepUpdates)
    assert list(got) == [TokenUpdate("a", [9], "length"), TokenUpdate("b", [EOS], "stop"),
                         TokenUpdate("c", [EOS], None)]
    assert [f.req_id for f in s.schedule().freed] == ["a", "b"]
    check_views(s)
