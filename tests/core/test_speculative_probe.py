"""The scheduler's n-gram probe (ppstate/speculative_probe.py, #33) says "proposal" exactly when the
prompt-lookup proposer finds a match, as the history grows token by token."""

from __future__ import annotations

import numpy as np

from ppstate.speculative import _last_match
from ppstate.speculative_probe import NgramProbe


class _Req:
    pass


def test_probe_equals_the_proposers_match_as_history_grows():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3):
        probe, req = NgramProbe(n), _Req()
        prompt = tuple(int(t) for t in rng.integers(0, 5, 6))
        outputs: list[int] = []
        for _ in range(40):
            h = np.array(prompt + tuple(outputs))
            want = h.size > n and _last_match(h, n) >= 0
            assert probe.has_proposal(req, prompt, outputs) == want, (n, h.tolist())
            outputs.append(int(rng.integers(0, 5)))


def test_scheduler_gives_drafts_only_once_the_history_repeats():
    """PP=1 sync, K = 2, probe n = 2, prompt without a repeated bigram: the decode rows carry no
    drafts until the received outputs (7, 8, 7, 8, ...) repeat a bigram, then 2 drafts each."""
    from ppstate.batch import StepResult
    from ppstate.budget import SchedulerConfig
    from ppstate.request import RequestSpec
    from ppstate.scheduler import Scheduler
    cfg = SchedulerConfig(pp_size=1, max_num_seqs=1, max_num_batched_tokens=64,
                          max_prefill_chunk=16, max_model_len=64, num_spec_tokens=2,
                          spec_probe_ngram=2, mode="sync")
    sched = Scheduler(cfg)
    sched.add_request(RequestSpec("a", (10, 11, 12, 13), 12))
    widths, emitted = [], 0
    while sched.has_unfinished() or sched.in_flight:
        out = sched.schedule()
        if out is None:
            continue
        q = int(out.num_scheduled_tokens[0])
        widths.append(q)
        n = 1 if emitted == 0 else q                     # every draft accepted
        ids = np.zeros((1, 3), dtype=np.int64)
        ids[0, :n] = [7 + (emitted + i) % 2 for i in range(n)]
        emitted += n
        sched.on_step_result(StepResult(out.step, ids, np.array([n], np.int32),
                                        np.zeros(1, np.int32)))
    # prefill (4), outputs 7 | 8 | 7 (no bigram repeated yet) | then (8, 7) was seen: drafts
    assert widths[:4] == [4, 1, 1, 1] and widths[4] == 3, widths
    assert emitted == 12


def _run(k: int, probe_n: int, prompts, max_tokens: int, token):
    """Overlapped PP=2, a small KV pool (rows need new blocks and some preempt), every decode
    row's result one token ``token(req_id, i)``; returns each step's (req_ids, slots, tokens,
    starts, block-table deltas, freed slots)."""
    from ppstate.batch import StepResult
    from ppstate.budget import SchedulerConfig
    from ppstate.request import RequestSpec
    from ppstate.scheduler import Scheduler
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=4, max_num_batched_tokens=64,
                          max_prefill_chunk=16, max_model_len=64, num_kv_blocks=12, block_size=4,
                          num_spec_tokens=k, spec_probe_ngram=probe_n)
    sched = Scheduler(cfg)
    for i, p in enumerate(prompts):
        sched.add_request(RequestSpec(f"r{i}", tuple(p), max_tokens))
    steps, pending, emitted = [], [], {}
    while sched.has_unfinished() or sched.in_flight:
        out = sched.schedule()
        if out is not None:
            steps.append((out.req_ids, out.slots.tolist(), out.num_scheduled_tokens.tolist(),
                          out.start_positions.tolist(), out.block_table_slots.tolist(),
                          out.block_table_cols.tolist(), out.block_table_ids.tolist(),
                          [(f.req_id, f.reason) for f in out.freed]))
            pending.append(out)
        if pending and (out is None or len(pending) > cfg.pp_size):
            o = pending.pop(0)
            ids = np.zeros((o.num_rows, 1 + k), dtype=np.int64)
            for r, rid in enumerate(o.req_ids):
                n = emitted.get(rid, 0)
                ids[r, 0] = token(rid, n)
                emitted[rid] = n + 1 if o.is_final_chunk[r] else n
            sampled = o.is_final_chunk.astype(np.int32)
            sched.on_step_result(StepResult(o.step, ids, sampled, np.zeros(o.num_rows, np.int32)))
    return steps


def test_draft_free_steps_are_scheduled_as_without_speculation(monkeypatch):
    """With the probe finding no proposal anywhere (no token repeats in any history), the K = 2
    scheduler issues the very steps of K = 0 (rows, starts, block deltas, preemptions
    included) through the bulk path: the row-by-row speculative path is never entered."""
    from ppstate.scheduler_rows import RowBuilder
    prompts = [list(range(100 * i, 100 * i + 10)) for i in range(5)]

    def token(rid, n):
        return 1000 * (1 + int(rid[1:])) + n             # never repeats

    off = _run(0, 0, prompts, 12, token)

    def no_spec_path(self, order):
        raise AssertionError("row-by-row speculative path entered")
    monkeypatch.setattr(RowBuilder, "_spec_decodes", no_spec_path)
    assert _run(2, 3, prompts, 12, token) == off
    preempted = [f[0] for s in off for f in s[7] if f[1] == "preempted"]
    assert (len(off), max(len(s[0]) for s in off), preempted) == (45, 2, ["r3", "r2", "r4", "r4"])
