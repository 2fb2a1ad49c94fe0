"""Speculative decoding on the real model (issue #14): the in-process pipeline (real Scheduler,
StageRunners, DeviceStates, StageModels; mirrors validated after every step on every rank) at
PP 1, 2 and 3, checked token by token against the transformers reference, with the acceptance
counted so that a proposer that never proposes anything useful fails the test."""

from __future__ import annotations

import functools

import pytest

from inproc_pipeline import InprocPipeline
from reference import greedy_reference, seeded_reference
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, ..." in SmolLM2 ids: the model continues the cycle, so n-gram
# drafts get accepted. The other prompt is ordinary prose ("The capital of France is").
REPETITIVE = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216] * 3 + [33, 28, 216]
ORDINARY = [504, 3575, 282, 4649, 314]
NEW = 16
RANGES = {1: [(0, 30)], 2: [(0, 16), (16, 30)], 3: [(0, 10), (10, 20), (20, 30)]}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stages_of(make_stages):
    """``stages_of(pp)``: the StageModels of one PP cut, built once per module and shared by its
    pipelines (each pipeline brings a fresh Scheduler and DeviceStates; a KV slot is written
    before it is read, as when the engine reuses a slot)."""
    return functools.cache(lambda pp: make_stages(RANGES[pp], max_num_reqs=4, max_model_len=128))


def run(stages_of, pp: int, requests: dict, k: int = 4, mode: str = "overlapped") -> InprocPipeline:
    pipe = InprocPipeline(stages_of(pp), max_num_seqs=4,
                          max_model_len=128, num_spec_tokens=k, spec_ngram=3, mode=mode)
    for rid, (prompt, params) in requests.items():
        pipe.add(rid, prompt, params)
    pipe.run_until(lambda p: p.idle, 400)
    return pipe


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_with_spec_equals_reference_and_drafts_are_accepted(stages_of, pp):
    pipe = run(stages_of, pp, {"rep": (REPETITIVE, greedy(NEW)), "ord": (ORDINARY, greedy(NEW))})
    assert tuple(pipe.tokens["rep"]) == greedy_reference(tuple(REPETITIVE), NEW)
    assert tuple(pipe.tokens["ord"]) == greedy_reference(tuple(ORDINARY), NEW)
    assert pipe.finish == {"rep": "length", "ord": "length"}
    s = pipe.sched.spec_stats()
    assert s["spec_accepted_tokens"] >= 8           # the cycle is predicted
    assert s["spec_accepted_tokens"] < s["spec_proposed_tokens"]  # and the prose mostly is not
    # every accepted draft saves a sampling row (32 tokens without speculation take 32 rows);
    # drafts are capped by max_tokens, so no row is wasted past the end
    rows = sum(int(o.is_final_chunk.sum()) for o in pipe.steps)
    assert rows == 2 * NEW - s["spec_accepted_tokens"]


def test_max_tokens_inside_an_accepted_run_stops_exactly(stages_of):
    """max_tokens 4: the prefill samples token 1, the next row carries 2 drafts (capped by
    max_tokens, K = 4) and both are accepted: tokens 2-4 in one row, then the request stops."""
    pipe = run(stages_of, 2, {"rep": (REPETITIVE, greedy(4))})
    assert tuple(pipe.tokens["rep"]) == greedy_reference(tuple(REPETITIVE), 4)
    assert pipe.finish == {"rep": "length"}
    assert pipe.sched.spec_stats() == {"spec_proposed_tokens": 2, "spec_accepted_tokens": 2,
                                       "spec_decode_rows": 1}
    decode_rows = [int(q) for o in pipe.steps for q, f in zip(o.num_scheduled_tokens, o.is_final_chunk)
                   if f and q <= 5]
    assert decode_rows[-1] == 3


def test_seeded_sampling_with_spec_gives_the_same_tokens(stages_of):
    """Verification samples each position with the sampler's own (seed, output index) uniform, so
    a seeded request's tokens do not depend on speculation (docs: rejection sampling)."""
    p = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=5, ignore_eos=True)
    pipe = run(stages_of, 2, {"s": (REPETITIVE, p)})
    want = seeded_reference(tuple(REPETITIVE), 8, p.temperature, p.top_p, p.top_k, p.seed)
    assert tuple(pipe.tokens["s"]) == want
    assert pipe.sched.spec_stats()["spec_accepted_tokens"] > 0


def test_sync_mode_with_spec_equals_reference(stages_of):
    """Sync mode (one step in flight, depth-1 PPHandlers): the correction is consumed one step
    later instead of pp_size steps later; same tokens."""
    pipe = run(stages_of, 2, {"rep": (REPETITIVE, greedy(10))}, mode="sync")
    assert tuple(pipe.tokens["rep"]) == greedy_reference(tuple(REPETITIVE), 10)
    assert pipe.sched.spec_stats()["spec_accepted_tokens"] > 0
