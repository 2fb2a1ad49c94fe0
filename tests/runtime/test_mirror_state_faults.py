"""Rank-local faults in the per-slot state a step reads are caught within one step (issue #27).

The worker code (StageRunner, DeviceState, the mirror checks) runs in one process over a 3-layer cut
of the embedded model (tests/helpers/mirror_faults.py); each fault is planted with the engine's own
``corrupt_state`` hook on one rank and must raise ``MirrorDivergence`` naming the rank, the slot,
the request and the field, about the first step the faulty rank runs after it.
"""

from __future__ import annotations

import numpy as np
import pytest

from mirror_faults import cut_maker, plant_and_catch, start
from ppstate.block_digest import digest_of, row_digests


@pytest.fixture(scope="module")
def cut(model_weights):
    return cut_maker(model_weights)


@pytest.mark.parametrize("pp,rank", [(2, 1), (2, 0), (3, 1)])
def test_shifted_block_ids_caught_on_that_rank_within_one_step(cut, pp, rank):
    """The issue's fault: the host table the step's metadata is built from, one slot's row + 1.
    The device table still holds the right ids, so the end-of-step comparison names the first
    column unless the row ran first (then the scheduler's digest catches it before the forward)."""
    err = plant_and_catch(start(cut(pp)), rank, ("block_table_np", 1))
    assert err.field in ("block_ids (digest vs scheduler)", "block_table[0]"), str(err)
    if err.field == "block_table[0]":
        assert err.cpu == err.device + 1      # host copy shifted, device right


def test_both_copies_wrong_caught_by_the_schedulers_digest(cut):
    """Host and device tables shifted alike: they agree with each other, only the scheduler's
    digest of the ids it decided tells them wrong, before the first forward that reads them (the
    digests cover the rows of a step: the slots whose tables it reads)."""
    pipe = start(cut(2))
    slot = pipe.sched.slots.lookup("victim")
    state = pipe.runners[1].state
    nb = int(state.mirror.num_blocks_np[slot])
    want = digest_of(pipe.sched.kv.pool.table("victim"))
    assert row_digests(state.block_table_np, state.mirror.num_blocks_np,
                       np.array([slot])).tolist() == [want]      # independent digest, healthy
    err = plant_and_catch(pipe, 1, ("block_table_np", 1), ("block_table", 1), reads=True)
    assert err.field == "block_ids (digest vs scheduler)" and nb >= 2
    assert err.device == digest_of(pipe.sched.kv.pool.table("victim"))  # the scheduler's decision


@pytest.mark.parametrize("field,delta,named", [
    ("block_table", 1, "block_table[0]"),
    ("total_len", 1, "total_len"),
    ("sampling_state.f32", 0.25, "sampling.temperature"),
    ("sampling_state.i64", 1, "sampling.top_k"),
    ("num_blocks", -1, "num_blocks"),
    ("all_token_ids", 1, "all_token_ids["),
])
def test_fault_in_each_validated_field_named(cut, field, delta, named):
    err = plant_and_catch(start(cut(2)), 0, (field, delta))
    assert err.field.startswith(named), str(err)
    assert err.cpu != err.device
