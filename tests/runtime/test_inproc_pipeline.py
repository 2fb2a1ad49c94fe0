"""The worker code (StageRunner, DeviceState, PPHandler, post-update kernels) at PP=2 in one
process, driven step by step (tests/helpers/inproc_pipeline.py), checked against transformers.

These tests act at exact steps (an abort while rank 0 still holds the aborted request's deferred
entry) and count ticks, never seconds. Mirrors are validated after every step on both ranks.
"""

from __future__ import annotations

import pytest

from inproc_pipeline import InprocPipeline
from reference import greedy_reference, one_thread, seeded_reference
from runtime.sampling_params import SamplingParams

PROMPT_A = [504, 3458, 282, 4649, 314, 1167, 30, 216, 9400, 2067]
PROMPT_B = [1205, 253, 1345, 11, 7630, 28, 457, 3520, 1099, 355, 28, 634, 19234]
B_TOKENS = 8
MAX_TICKS = 200     # a few dozen ticks suffice; the bound turns a hang into a failure


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The stages compute in this process on one torch thread, as a rank does (the default two
    crawl on a busy 2-core machine: reference.one_thread)."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def stages(make_stages):
    """PP=2 cut of the embedded model with one slot (the layer split the launcher uses)."""
    return make_stages([(0, 16), (16, 30)], max_num_reqs=1, max_model_len=128)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _unsampled_entries_of(pipe: InprocPipeline, req_id: str) -> list[int]:
    """Steps queued in rank 0's PPHandler with a row of ``req_id`` that the client has not seen
    sampled yet (the step has not left the last rank)."""
    by_step = {o.step: o for o in pipe.steps}
    return [s for s in pipe.handler(0).pending_steps()
            if req_id in by_step[s].req_ids and s > pipe.last_result_step]


@pytest.mark.parametrize("abort_after", [1, 3])
def test_slot_reuse_after_abort_with_deferred_entry_in_flight(stages, abort_after):
    """A holds the only slot, B waits; A is aborted while rank 0 has not yet consumed A's last
    broadcast. B then runs in the same slot, and A's late token must not land in B's state."""
    pipe = InprocPipeline(stages, max_num_seqs=1, max_model_len=128)
    pipe.add("A", PROMPT_A, _greedy(100))
    pipe.add("B", PROMPT_B, _greedy(B_TOKENS))
    pipe.run_until(lambda p: len(p.tokens["A"]) >= abort_after
                   and _unsampled_entries_of(p, "A"), MAX_TICKS)
    assert pipe.sched.num_waiting == 1 and pipe.sched.state_of("B") == "waiting"
    in_flight = _unsampled_entries_of(pipe, "A")
    generation = int(pipe.handler(0).generation[0])

    issued = len(pipe.steps)
    assert pipe.abort("A")
    assert pipe.sched.state_of("A") == "finished_aborted"
    pipe.tick()
    nxt = pipe.steps[issued]                 # the very next step frees A's slot and admits B
    assert [(f.req_id, f.slot) for f in nxt.freed] == [("A", 0)]
    assert [(n.req_id, n.slot) for n in nxt.new_requests] == [("B", 0)]
    assert int(pipe.handler(0).generation[0]) == generation + 1
    assert set(in_flight) & set(pipe.handler(0).pending_steps()), \
        "A's entry is still queued after B took the slot (the case the generation check guards)"

    pipe.run_until(lambda p: "B" in p.finish, MAX_TICKS)
    assert pipe.finish["B"] == "length"
    assert tuple(pipe.tokens["B"]) == greedy_reference(tuple(PROMPT_B), B_TOKENS)
    a = pipe.tokens["A"]
    assert len(a) >= abort_after and tuple(a) == greedy_reference(tuple(PROMPT_A), len(a))
    pipe.run_until(lambda p: p.idle, MAX_TICKS)
    assert pipe.sched.slots.num_free == 1
    # the safety net fired and was counted: A's queued rows on rank 0 (generation check), and
    # A's rows the last rank sampled into the old slot that the scheduler dropped
    assert pipe.handler(0).num_dropped >= len(in_flight) >= 1
    assert pipe.sched.kv_stats()["discarded_result_rows"] == pipe.handler(0).num_dropped


def test_abort_does_not_disturb_the_request_on_another_slot(make_stages):
    """Two slots: freeing A's slot bumps only A's generation on rank 0; C's deferred entries stay
    valid and C's tokens equal the reference (fails if the free touches every slot)."""
    pipe = InprocPipeline(make_stages([(0, 16), (16, 30)], max_num_reqs=2, max_model_len=128),
                          max_num_seqs=2, max_model_len=128)
    pipe.add("A", PROMPT_A, _greedy(100))
    pipe.add("C", PROMPT_B, _greedy(B_TOKENS))
    pipe.run_until(lambda p: len(p.tokens["A"]) >= 2 and _unsampled_entries_of(p, "C"), MAX_TICKS)
    slot_a, slot_c = pipe.sched.slots.lookup("A"), pipe.sched.slots.lookup("C")
    before = pipe.handler(0).generation.copy()
    pipe.abort("A")
    pipe.run_until(lambda p: "C" in p.finish, MAX_TICKS)
    after = pipe.handler(0).generation
    assert (after[slot_a], after[slot_c]) == (before[slot_a] + 1, before[slot_c])
    assert tuple(pipe.tokens["C"]) == greedy_reference(tuple(PROMPT_B), B_TOKENS)


def test_seeded_sampling_pp2_equals_pp1_and_reference(stages, make_stages):
    """temperature / top-p / top-k / seed: same tokens at PP=2, at PP=1 and from the reference."""
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.2, top_k=20, seed=12, ignore_eos=True)]
    pp1 = make_stages([(0, 30)], max_num_reqs=1, max_model_len=128)
    got = {}
    for name, st in (("pp2", stages), ("pp1", pp1)):
        pipe = InprocPipeline(st, max_num_seqs=1, max_model_len=128)
        for i, p in enumerate(params):
            pipe.add(f"s{i}", PROMPT_A, p)
        pipe.run_until(lambda q: q.idle, MAX_TICKS)
        got[name] = [tuple(pipe.tokens[f"s{i}"]) for i in range(len(params))]
    want = [seeded_reference(tuple(PROMPT_A), p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed)
            for p in params]
    assert got["pp2"] == got["pp1"] == want


def test_device_state_dtypes_and_planted_corruption_is_caught():
    """DeviceState's per-slot tensors are int64; ``corrupt`` (the test hook the process-level
    corruption test drives over ZMQ) makes ``validate`` name rank, slot and field."""
    import torch

    from ppstate.batch import NewRequest
    from ppstate.errors import MirrorDivergence
    from runtime.worker.device_state import DeviceState
    st = DeviceState(2, 16, 1, torch.device("cpu"), rank=1)
    names = ("num_computed_tokens", "num_computed_prefill_tokens", "prefill_len", "max_seq_len",
             "total_len", "last_sampled_tokens", "all_token_ids")
    assert {n: getattr(st, n).dtype for n in names} == {n: torch.int64 for n in names}
    st.add_requests([NewRequest("r", 1, (5, 6, 7), 10)])
    st.validate(step=0)
    st.corrupt(1, "max_seq_len", 2)
    with pytest.raises(MirrorDivergence) as info:
        st.validate(step=4)
    e = info.value
    assert (e.rank, e.step, e.slot, e.req_id, e.field, e.cpu, e.device) == (
        1, 4, 1, "r", "max_seq_len", 10, 12)
