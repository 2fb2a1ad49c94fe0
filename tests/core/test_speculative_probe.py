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
