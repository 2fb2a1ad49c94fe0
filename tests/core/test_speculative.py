"""Speculative decoding, the pure parts (issue #14): the n-gram proposer, the acceptance rule and
its equivalence to rejection sampling for a deterministic draft, and the scheduler's accounting of
1 + k tokens per decode row (budget, max_tokens / max_seq_len cap, deferred correction)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppstate.batch import StepResult
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from ppstate.speculative import accept_prefix, drafts_for_row, propose_ngram, verify_rows
from reference import sample_from_logits


# ---- proposer -----------------------------------------------------------------------------------
def test_propose_follows_most_recent_earlier_match():
    h = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert propose_ngram(h, n=2, k=3).tolist() == [2, 3, 6]      # the match at index 6, not 1
    assert propose_ngram(h, n=3, k=2).tolist() == [7, 7]         # "3 6 7" never earlier: pad
    assert propose_ngram(h, n=1, k=4).tolist() == [2, 3, 6, 7]
    assert propose_ngram([4, 4, 4], n=2, k=3).tolist() == [4, 4, 4]  # overlap allowed, then pad


def test_propose_edges():
    assert propose_ngram([3], n=1, k=2).tolist() == [3, 3]
    assert propose_ngram([1, 2, 1], n=1, k=0).tolist() == []
    assert propose_ngram([1, 2, 3, 1], n=1, k=5).tolist() == [2, 3, 1, 1, 1]  # short follow: pad
    with pytest.raises(ValueError):
        propose_ngram([], n=1, k=1)
    with pytest.raises(ValueError):
        propose_ngram([1], n=0, k=1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4), st.integers(0, 5))
def test_propose_matches_a_naive_scan(h, n, k):
    got = propose_ngram(h, n, k).tolist()
    want = [h[-1]] * k
    for s in range(len(h) - n - 1, -1, -1):  # most recent occurrence ending before the end
        if len(h) > n and h[s:s + n] == h[-n:]:
            follow = h[s + n:s + n + k]
            want[:len(follow)] = follow
            break
    assert got == want


# ---- acceptance -----------------------------------------------------------------------------------
def test_accept_longest_matching_prefix_plus_bonus():
    assert accept_prefix([4, 5, 6, 9], [4, 5, 6]) == 3          # all accepted + bonus 9
    assert accept_prefix([4, 8, 6, 9], [4, 5, 6]) == 1          # emits 4, 8
    assert accept_prefix([7, 5, 6, 9], [4, 5, 6]) == 0          # emits the target's 7 only
    assert accept_prefix([3], []) == 0
    with pytest.raises(ValueError):
        accept_prefix([1, 2], [1, 2])
    ns, nr = verify_rows(np.array([[4, 5, 6, 9], [7, 0, 0, 0], [4, 8, 0, 0]]),
                         np.array([[4, 5, 6], [0, 0, 0], [4, 5, 0]]), np.array([3, 0, 2]))
    assert ns.tolist() == [4, 1, 2] and nr.tolist() == [0, 0, 1]


def test_sample_then_match_is_rejection_sampling_for_a_point_mass_draft():
    """Leviathan et al. 2023 Alg. 1 with q = one-hot(d): accept d w.p. p(d), else draw from
    norm(max(0, p - q)). Sampling t ~ p with the runtime's rule (one uniform u) and accepting iff
    t == d gives, over a uniform grid of u, the same acceptance mass and residual law."""
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.25, 0.05]))
    p = np.exp(logits) / np.exp(logits).sum()
    grid = (np.arange(20000) + 0.5) / 20000
    draws = np.array([sample_from_logits(logits, 1.0, 1.0, 0, u) for u in grid])
    for d in range(5):
        acc = (draws == d).mean()
        assert acc == pytest.approx(p[d], abs=1e-4)
        residual = np.bincount(draws[draws != d], minlength=5) / (draws != d).sum()
        want = np.maximum(p - np.eye(5)[d], 0)
        assert residual == pytest.approx(want / want.sum(), abs=1e-3)


def test_drafts_for_row_caps():
    assert drafts_for_row(room=10, num_spec_tokens=4, budget_tokens=100) == 4
    assert drafts_for_row(room=2, num_spec_tokens=4, budget_tokens=100) == 2   # max_tokens
    assert drafts_for_row(room=10, num_spec_tokens=4, budget_tokens=3) == 2    # budget
    assert drafts_for_row(room=-1, num_spec_tokens=4, budget_tokens=3) == 0


# ---- scheduler accounting -------------------------------------------------------------------------
def _answer(sched, accept):
    """Answer the oldest in-flight step: decode rows accept ``accept(req_id)`` of their drafts
    (token ids 100, 101, ...); final chunks sample one token."""
    out = sched.results.in_flight[0]
    drafts = sched.results.in_flight_drafts[0]
    n, w = out.num_rows, 1 + sched.config.num_spec_tokens
    ids = np.zeros((n, w), dtype=np.int64)
    ns, nr = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
    for i, rid in enumerate(out.req_ids):
        if not out.is_final_chunk[i]:
            continue
        k = drafts[i]
        j = min(accept(rid), k)
        ids[i, :j + 1] = 100 + np.arange(j + 1)
        ns[i], nr[i] = j + 1, k - j
    return sched.on_step_result(StepResult(out.step, ids, ns, nr))


def _run(config, specs, accept, max_steps=400):
    sched = Scheduler(config)
    for s in specs:
        sched.add_request(s)
    outs, tokens = [], {s.req_id: [] for s in specs}
    while (sched.has_unfinished() or sched.in_flight) and len(outs) < max_steps:
        out = sched.schedule()
        if out is None:
            for u in _answer(sched, accept):
                tokens[u.req_id] += u.token_ids
        else:
            outs.append(out)
    return sched, outs, tokens


@pytest.mark.parametrize("accept_all", [True, False])
def test_decode_rows_carry_1_plus_k_and_finish_at_exactly_max_tokens(accept_all):
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=16,
                          max_model_len=64, num_spec_tokens=3)
    specs = [RequestSpec(f"r{i}", tuple(range(10, 18)), m) for i, m in enumerate((9, 2, 1, 12))]
    sched, outs, tokens = _run(cfg, specs, (lambda rid: 3) if accept_all else (lambda rid: 0))
    assert {r: len(t) for r, t in tokens.items()} == {"r0": 9, "r1": 2, "r2": 1, "r3": 12}
    decode_lens = [int(q) for o in outs for q, st_, f in
                   zip(o.num_scheduled_tokens, o.start_positions, o.is_final_chunk) if st_ >= 8]
    assert max(decode_lens) == 4 and min(decode_lens) >= 1
    for o in outs:  # every row's positions stay inside the request's max_seq_len
        for rid, q, st_ in zip(o.req_ids, o.num_scheduled_tokens, o.start_positions):
            m = next(s.max_tokens for s in specs if s.req_id == rid)
            assert st_ + q <= 8 + m - 1
    stats = sched.spec_stats()
    if accept_all:  # r0: 1 (prefill) + 4 + 4 = 9; r3: 1 + 4 + 4 + 3 = 12; r1: 1 + 1 (k = 0)
        assert stats["spec_proposed_tokens"] == stats["spec_accepted_tokens"] == 3 + 3 + 3 + 3 + 2
    else:
        assert stats["spec_accepted_tokens"] == 0 and stats["spec_proposed_tokens"] > 0
    assert sched.num_running == 0 and sched.arrays.num_computed_tokens.sum() >= 0


def test_rejection_corrects_optimistic_counters():
    cfg = SchedulerConfig(pp_size=1, max_num_seqs=1, max_num_batched_tokens=64, max_prefill_chunk=16,
                          max_model_len=64, num_spec_tokens=4, mode="sync")
    sched = Scheduler(cfg)
    sched.add_request(RequestSpec("a", tuple(range(10, 16)), 20))
    prefill = sched.schedule()
    assert prefill.num_scheduled_tokens.tolist() == [6]
    _answer(sched, lambda rid: 0)
    dec = sched.schedule()
    assert (dec.start_positions.tolist(), dec.num_scheduled_tokens.tolist()) == ([6], [5])
    assert sched.arrays.num_computed_tokens[0] == 11 and sched.arrays.num_sampling_rows[0] == 6
    _answer(sched, lambda rid: 1)                       # 1 of 4 accepted: 3 rejected
    assert sched.arrays.num_computed_tokens[0] == 8 and sched.arrays.num_sampling_rows[0] == 3
    nxt = sched.schedule()
    assert nxt.start_positions.tolist() == [8]          # prompt 6 + 3 outputs - 1
    assert sched.spec_stats() == {"spec_proposed_tokens": 4, "spec_accepted_tokens": 1,
                                  "spec_decode_rows": 1}


def test_budget_limits_drafts():
    cfg = SchedulerConfig(pp_size=1, max_num_seqs=4, max_num_batched_tokens=6, max_prefill_chunk=4,
                          max_model_len=64, num_spec_tokens=4, mode="sync")
    sched = Scheduler(cfg)
    for r in ("a", "b"):
        sched.add_request(RequestSpec(r, (1, 2, 3), 30))
    sched.schedule()
    _answer(sched, lambda rid: 0)
    out = sched.schedule()  # a: 1 + 4 = 5 tokens, b: 1 token left in the budget of 6
    assert out.num_scheduled_tokens.tolist() == [5, 1]
