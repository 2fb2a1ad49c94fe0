"""The one-copy layout of the after-step check (runtime/worker/state_check.py) names every field.

A rank's DeviceState on the CPU (the per-step state work of ``runtime.bench mirror``: block deltas
and both post-updates for 8 decode rows) is checked by the asynchronous check (one flat copy of
counters, ``total_len``, block table and sampling tables) and by the synchronous one (in-place
comparison); a fault planted on one side of one field in slot 5 is named by both, with the field,
slot, request and both values.
"""

import numpy as np
import pytest
import torch

from ppstate.errors import MirrorDivergence
from runtime.bench.rank_loop import RankLoop
from runtime.worker.mirror_check import AsyncMirrorCheck

FAULTS = [("num_computed_tokens", "num_computed_tokens"), ("max_seq_len", "max_seq_len"),
          ("mirror.num_blocks_np", "num_blocks"), ("total_len", "total_len"),
          ("total_len_np", "total_len"), ("block_table", "block_table[0]"),
          ("sampling_state.f32", "sampling.temperature"), ("sampling_state.i64", "sampling.top_k")]


def _plant(state, field: str) -> None:
    obj = state
    for part in field.split(".")[:-1]:
        obj = getattr(obj, part)
    getattr(obj, field.split(".")[-1])[5] += 1


@pytest.mark.parametrize("kernel", ["graph", "fused"])
@pytest.mark.parametrize("field,named", FAULTS)
def test_fault_named_by_async_and_sync_check(field, named, kernel):
    """``kernel="fused"``: the flag from the fused Triton kernel (the interpreter on the CPU)."""
    loop = RankLoop(8, torch.device("cpu"), prompt_len=32, max_model_len=300)
    check = AsyncMirrorCheck(loop.state, rank=0, kernel=kernel)
    for _ in range(3):                       # healthy steps pass
        loop.step(False)
        check.snapshot(loop.step_no - 1)
    assert check.checked_steps == 3
    loop.step(False)
    _plant(loop.state, field)
    with pytest.raises(MirrorDivergence) as exc:
        check.snapshot(loop.step_no - 1)
    e = exc.value
    assert (e.field, e.slot, e.req_id, e.step) == (named, 5, "r5", 3)
    assert abs(e.cpu - e.device) >= 1
    with pytest.raises(MirrorDivergence) as sync:
        loop.state.validate(3)
    assert (sync.value.field, sync.value.slot, sync.value.cpu, sync.value.device) == \
        (named, 5, e.cpu, e.device)


def test_counters_are_rows_of_one_buffer():
    """The mirrored counters and total_len are views of ``DeviceState.fields`` (one copy reads
    them): a write through the attribute shows in the buffer."""
    loop = RankLoop(4, torch.device("cpu"), prompt_len=32, max_model_len=100)
    st = loop.state
    st.num_blocks[2] += 7
    st.total_len[1] += 3
    assert st.fields[4, 2].item() == st.num_blocks[2].item()
    assert st.fields[5].tolist() == st.total_len.tolist() == [32, 35, 32, 32]
    diff = st.fields.numpy()[:5] - st.mirror.values                  # [F, 4]
    assert np.flatnonzero(diff).tolist() == [4 * 4 + 2] and diff[4, 2] == 7


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("field,named,cpu,device", [
    ("sampling_state.logit_bias.ids", "logit_bias.ids[0]", 12, 13),
    ("sampling_state.logit_bias.ids_np", "logit_bias.ids[0]", 13, 12),
    ("sampling_state.logit_bias.values", "logit_bias.values[0]", None, None),
])
def test_logit_bias_rows_of_biased_live_slots_checked(field, named, cpu, device, dev):
    """The logit-bias tables (issue #27): the rows of the live slots holding a bias are compared
    with their host copies by both checks; an unbiased slot's stale row is never read, so a
    change there is not a divergence."""
    from ppstate.batch import NewRequest
    from runtime.worker.device_state import DeviceState
    st = DeviceState(8, 64, 1, torch.device(dev), rank=1, block_size=16)
    bias = {"logit_bias": [[12, 5.0], [7, -3.0]]}
    st.add_requests([NewRequest("b2", 2, (1, 2, 3), 20, sampling=bias),
                     NewRequest("b5", 5, (1, 2, 3), 20, sampling=bias),
                     NewRequest("plain", 6, (1, 2, 3), 20)])
    check = AsyncMirrorCheck(st, rank=1)
    check.snapshot(0)
    st.validate(0)
    st.sampling_state.logit_bias.ids[6] += 1      # slot 6 holds no bias: its row is never read
    check.snapshot(1)
    st.validate(1)
    st.sampling_state.logit_bias.ids[6] -= 1
    _plant(st, field)
    with pytest.raises(MirrorDivergence) as exc:
        check.snapshot(2)            # CPU: compared at once; CUDA: when its flag lands
        check.poll(block=True)
    e = exc.value
    assert (e.field, e.slot, e.req_id, e.step, e.rank) == (named, 5, "b5", 2, 1), str(e)
    if cpu is not None:
        assert (e.cpu, e.device) == (cpu, device)
    else:   # fp32 bits: 5.0 on the host, 6.0 on the device
        assert np.array([e.cpu, e.device], dtype=np.int32).view(np.float32).tolist() == [5.0, 6.0]
    with pytest.raises(MirrorDivergence) as sync:
        st.validate(2)
    assert (sync.value.field, sync.value.slot, sync.value.cpu, sync.value.device) == \
        (named, 5, e.cpu, e.device)


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("where", ["row", "last"])
def test_token_ids_checked_against_the_host_copy(dev, where):
    """``all_token_ids`` (prompt ids, decode inputs, penalty history) against the exact host copy
    kept from admissions and the sampled ids (runtime/worker/token_check.py): healthy steps pass
    (the host copy follows each step's sampled ids); a fault in one slot's row, the whole row
    (the engine's ``corrupt_state`` hook) or only the last sampled id (the next decode input),
    is named by the async check (row digest, then the first divergent position) and the
    synchronous one (in place), with the same position and values."""
    loop = RankLoop(8, torch.device(dev), prompt_len=32, max_model_len=300)
    st = loop.state
    st.tokens = loop.token_mirror
    check = AsyncMirrorCheck(st, rank=0)
    for _ in range(4):
        loop.step(False)
        check.snapshot(loop.step_no - 1)
    check.poll(block=True)
    assert check.checked_steps == 4
    t = int(st.total_len_np[5])
    assert t == 36 and st.tokens.ids_np[5, 32:t].tolist() == [7] * 4          # sampled ids
    assert st.tokens.ids_np[5, :32].tolist() == list(range(100, 132))          # prompt ids
    loop.step(False)
    if where == "row":
        st.corrupt(5, "all_token_ids", 1)
        pos, cpu, device = 0, 100, 101
    else:
        st.all_token_ids[5, t] += 3                   # the id the next decode step reads
        pos, cpu, device = t, 7, 10
    with pytest.raises(MirrorDivergence) as exc:
        check.snapshot(loop.step_no - 1)
        check.poll(block=True)
    e = exc.value
    assert (e.field, e.slot, e.req_id, e.step, e.cpu, e.device) == \
        (f"all_token_ids[{pos}]", 5, "r5", 4, cpu, device), str(e)
    with pytest.raises(MirrorDivergence) as sync:
        st.validate(4)
    assert (sync.value.field, sync.value.cpu, sync.value.device) == (e.field, cpu, device)


def test_host_copies_live_in_the_flat_layout():
    """The host copies the check compares are views of ``DeviceState.host_flat``, which is the
    flat layout over every block-table column (so one copy per step carries them all)."""
    from runtime.worker import state_check
    loop = RankLoop(4, torch.device("cpu"), prompt_len=32, max_model_len=100)
    st = loop.state
    st.total_len_np[1] += 3
    st.block_table_np[2, 1] = 77
    st.mirror.num_blocks_np[3] += 5
    st.sampling_state.f32_np[0, 1] = 0.5
    cols = st.block_table_np.shape[1]
    assert st.host_flat.tobytes() == state_check.host_flat(st, cols).tobytes()
    counters, t, _, bt, f32, _, _ = state_check.unpack(st.host_flat, 4, cols)
    assert (t[1], bt[2, 1], f32.view(np.float32)[0, 1]) == (35, 77, 0.5)
    assert counters[4, 3] == st.mirror.num_blocks_np[3] == st.num_blocks[3].item() + 5


class _FakeGraph:
    """Stands in for a captured graph on the CPU: replays the buffer's work op by op over the
    graph's layout (every column, no logit-bias rows)."""

    def __init__(self, dev, k: int) -> None:
        self.dev, self.k = dev, k

    def replay(self) -> None:
        from runtime.worker import state_check
        size = state_check.flat_size(self.dev.n, self.dev.cols)
        self.dev.enqueue(self.k, size, self.dev.cols, np.zeros(0, dtype=np.int64))


def _scheduled(loop, step: int):
    from ppstate.batch import SchedulerOutput
    n = loop.n
    return SchedulerOutput(step, (), loop.slots, np.ones(n, dtype=np.int32),
                           loop.tokens.astype(np.int32), np.ones(n, dtype=bool),
                           block_digests=loop.digests.of(loop.slots))


@pytest.mark.parametrize("graph_layout,kernel", [(False, "graph"), (True, "graph"),
                                                 (True, "fused")])
def test_both_table_copies_wrong_caught_by_the_digest_in_the_snapshot(graph_layout, kernel):
    """Host and device tables shifted alike agree with each other; the digest of the device
    table, compared with the scheduler's in the step's snapshot, names the slot (``cpu``: the
    rank's digest, ``device``: the scheduler's); without the scheduler's digests it passes."""
    from ppstate.block_digest import row_digests
    loop = RankLoop(8, torch.device("cpu"), prompt_len=32, max_model_len=300)
    check = AsyncMirrorCheck(loop.state, rank=0, kernel=kernel)
    if graph_layout:
        check._graphed_tokens = loop.state.tokens
        check.dev.graphs = [_FakeGraph(check.dev, 0), _FakeGraph(check.dev, 1)]
        check.dev.use_graphs = True
    st = loop.state
    for _ in range(3):
        loop.step(False)
        check.expect_digests(_scheduled(loop, loop.step_no - 1))
        check.snapshot(loop.step_no - 1)
    loop.step(False)
    st.block_table_np[5, 0] += 1
    st.block_table[5, 0] += 1
    check.snapshot(loop.step_no - 1)           # no digests expected: the copies agree
    assert check.checked_steps == 4
    loop.step(False)
    check.expect_digests(_scheduled(loop, loop.step_no - 1))
    with pytest.raises(MirrorDivergence) as exc:
        check.snapshot(loop.step_no - 1)
    e = exc.value
    assert (e.field, e.slot, e.req_id, e.step) == ("block_ids (digest vs scheduler)", 5, "r5", 4)
    assert e.device == loop.digests.values[5] != e.cpu
    assert e.cpu == row_digests(st.block_table_np, st.mirror.num_blocks_np, np.array([5]))[0]
