"""Rank-local faults in the per-slot state a step reads are caught within one step (issue #27).

The worker code (StageRunner, DeviceState, the mirror checks) runs in one process
(tests/helpers/inproc_pipeline.py) over a 3-layer cut of the embedded model, so a test can plant a
fault with the engine's own ``corrupt_state`` hook (``DeviceState.corrupt``) on one rank at an
exact step and see which step raises. Each fault must raise ``MirrorDivergence`` naming the rank,
the slot, the request and the field, in the first step the faulty rank runs after it.
"""

from __future__ import annotations

import numpy as np
import pytest

from inproc_pipeline import InprocPipeline
from ppstate.block_digest import digest_of, row_digests
from ppstate.errors import MirrorDivergence
from runtime.sampling_params import SamplingParams

PROMPT = [504, 3458, 282, 4649, 314, 1167, 30, 216, 9400, 2067, 1205, 253, 1345, 11, 7630, 28, 457]
MAX_TICKS = 60


@pytest.fixture(scope="module")
def cut(model_weights):
    """``make(pp)``: StageModels of the first 3 layers of the embedded model (final norm and the
    tied head on the last stage), one layer per rank at PP=3, (1, 2) at PP=2."""
    from runtime.model.stage import StageModel
    import torch
    cfg, weights = model_weights
    small = cfg.model_copy(update={"num_layers": 3})
    built: dict[int, list] = {}

    def make(pp: int) -> list:
        if pp not in built:
            ranges = [(0, 1), (1, 3)] if pp == 2 else [(0, 1), (1, 2), (2, 3)]
            built[pp] = [StageModel(small, r, weights, max_num_reqs=2, max_model_len=96,
                                    dtype=torch.float32, device="cpu").eval() for r in ranges]
        return built[pp]
    return make


def _pipe(cut, pp: int) -> InprocPipeline:
    pipe = InprocPipeline(cut(pp), max_num_seqs=2, max_model_len=96, max_prefill_chunk=8)
    pipe.add("victim", PROMPT, SamplingParams(max_tokens=40, temperature=0.7, top_k=20, seed=3,
                                              ignore_eos=True))
    pipe.add("other", PROMPT[:9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    pipe.run_until(lambda p: len(p.tokens["victim"]) >= 4, MAX_TICKS)
    return pipe


def _fault(pipe: InprocPipeline, rank: int, *corruptions: tuple[str, int],
           reads: bool = False) -> MirrorDivergence:
    """Plant ``corruptions`` (field, delta) on ``rank``'s slot of the victim; tick until a step
    raises. Asserts it is the first step ``rank`` runs afterwards (with ``reads``: the first
    that has a row of the victim, i.e. reads its table) and names rank, slot and request."""
    slot = pipe.sched.slots.lookup("victim")
    state = pipe.runners[rank].state
    for field, delta in corruptions:
        state.corrupt(slot, field, delta)
    before = pipe.runners[rank].running_step
    with pytest.raises(MirrorDivergence) as info:
        pipe.run_until(lambda p: False, MAX_TICKS)
    err = info.value
    issued = [o.step for o in pipe.steps if o.step > before and
              (not reads or "victim" in o.req_ids)]
    assert err.rank == rank and err.slot == slot and err.req_id == "victim", str(err)
    assert err.step == issued[0], (before, issued, str(err))    # the next step (that reads it)
    assert f"rank {rank} step {err.step}" in str(err) and f"slot {slot}" in str(err)
    return err


@pytest.mark.parametrize("pp,rank", [(2, 1), (2, 0), (3, 1)])
def test_shifted_block_ids_caught_on_that_rank_within_one_step(cut, pp, rank):
    """The issue's fault: the host table the step's metadata is built from, one slot's row + 1.
    The device table still holds the right ids, so the end-of-step comparison names the first
    column unless the row ran first (then the scheduler's digest catches it before the forward)."""
    err = _fault(_pipe(cut, pp), rank, ("block_table_np", 1))
    assert err.field in ("block_ids (digest vs scheduler)", "block_table[0]"), str(err)
    if err.field == "block_table[0]":
        assert err.cpu == err.device + 1      # host copy shifted, device right


def test_both_copies_wrong_caught_by_the_schedulers_digest(cut):
    """Host and device tables shifted alike: they agree with each other, only the scheduler's
    digest of the ids it decided tells them wrong, before the first forward that reads them (the
    digests cover the rows of a step: the slots whose tables it reads)."""
    pipe = _pipe(cut, 2)
    slot = pipe.sched.slots.lookup("victim")
    state = pipe.runners[1].state
    nb = int(state.mirror.num_blocks_np[slot])
    want = digest_of(pipe.sched.kv.pool.table("victim"))
    assert row_digests(state.block_table_np, state.mirror.num_blocks_np,
                       np.array([slot])).tolist() == [want]      # independent digest, healthy
    err = _fault(pipe, 1, ("block_table_np", 1), ("block_table", 1), reads=True)
    assert err.field == "block_ids (digest vs scheduler)" and nb >= 2
    assert err.device == digest_of(pipe.sched.kv.digests.table[slot, :int(
        pipe.sched.kv.digests.num_blocks[slot])].tolist())         # the scheduler's decision


@pytest.mark.parametrize("field,delta,named", [
    ("block_table", 1, "block_table[0]"),
    ("total_len", 1, "total_len"),
    ("sampling_state.f32", 0.25, "sampling.temperature"),
    ("sampling_state.i64", 1, "sampling.top_k"),
    ("num_blocks", -1, "num_blocks"),
])
def test_fault_in_each_validated_field_named(cut, field, delta, named):
    err = _fault(_pipe(cut, 2), 0, (field, delta))
    assert err.field.startswith(named), str(err)
    assert err.cpu != err.device
