"""Async mirror validation (runtime/worker/mirror_check.py): a divergence planted on rank 1 is
caught within one step, named by rank, step, slot, request, field and values; clean runs pass.
CPU (synchronous copies) always; CUDA (pinned async copies + events) when a GPU is present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppstate.batch import NewRequest
from ppstate.errors import MirrorDivergence
from runtime.worker.device_state import DeviceState
from runtime.worker.mirror_check import AsyncMirrorCheck

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _state(device: str) -> DeviceState:
    st = DeviceState(8, 64, 1, torch.device(device), rank=1, block_size=64)
    st.add_requests([NewRequest(f"r{s}", s, tuple(range(5 + s)), 40) for s in (1, 3, 6)])
    slots = np.array([1, 3, 6])
    st.apply_block_updates(slots, np.zeros(3, dtype=np.int64), np.array([5, 2, 7]))  # 1 block each
    return st


def _step(st: DeviceState) -> None:
    slots = np.array([1, 3, 6])
    q = np.array([2, 1, 3])
    st.apply_scheduled(torch.as_tensor(slots, device=st.device), torch.as_tensor(q, device=st.device),
                       slots, q)


@pytest.mark.parametrize("device", DEVICES)
def test_clean_steps_pass_and_planted_divergence_is_caught_within_one_step(device):
    st = _state(device)
    chk = AsyncMirrorCheck(st)
    for step in range(5):
        _step(st)
        chk.snapshot(step)
    chk.poll(block=True)
    assert chk.checked_steps == 5
    _step(st)
    st.corrupt(3, "num_computed_tokens", 7)          # planted at step 5
    caught = None
    for step in (5, 6):
        try:
            if step == 6:
                _step(st)
            chk.snapshot(step)      # CPU: compared at once; CUDA: step 5's copy is still pending
        except MirrorDivergence as exc:
            caught = (step, exc)
            break
    assert caught is not None and caught[0] == (5 if device == "cpu" else 6)   # within one step
    e = caught[1]
    assert (e.rank, e.step, e.slot, e.req_id, e.field) == (1, 5, 3, "r3", "num_computed_tokens")
    assert (e.cpu, e.device) == (6, 13)


@pytest.mark.parametrize("device", DEVICES)
def test_block_count_short_of_computed_tokens_is_caught(device):
    """Device and mirror agree, but slot 6 holds one block fewer than its computed tokens need
    (invariant 9): the vectorised check must still fail and name the slot."""
    st = _state(device)
    chk = AsyncMirrorCheck(st)
    _step(st)
    chk.snapshot(0)
    for _ in range(21):            # slot 6: 3 tokens per step, 66 after 22 steps > 64
        _step(st)
    with pytest.raises(MirrorDivergence) as info:
        chk.snapshot(1)
        chk.poll(block=True)
    e = info.value
    assert (e.rank, e.step, e.slot, e.req_id) == (1, 1, 6, "r6") and e.field.startswith("num_blocks")
    assert (e.cpu, e.device) == (1, 2)


@pytest.mark.parametrize("device", DEVICES)
def test_traced_checks_keep_their_place_and_record_the_verdict(device, tmp_path):
    """Tracing: each snapshot's mirror.check lands where the synchronous check would put it (before
    the next step's events), with the comparison's verdict; a divergence is recorded as ok=false
    with the message the raised MirrorDivergence carries."""
    from ppstate.events import JsonlSink, read_jsonl
    path = tmp_path / "rank1.jsonl"
    sink = JsonlSink(path)
    st = _state(device)
    chk = AsyncMirrorCheck(st, sink=sink, rank=1)
    for step in range(3):
        sink.emit("rank.step", step=step, rank=1, num_rows=3)
        _step(st)
        chk.snapshot(step)
    st.corrupt(3, "num_computed_tokens", 7)
    sink.emit("rank.step", step=3, rank=1, num_rows=3)
    with pytest.raises(MirrorDivergence) as info:
        chk.snapshot(3)
        chk.poll(block=True)
    sink.close()
    events = read_jsonl(path)
    assert [(e["kind"], e["step"]) for e in events] == [
        (k, s) for s in range(4) for k in ("rank.step", "mirror.check")]
    checks = [e for e in events if e["kind"] == "mirror.check"]
    assert [c["slots"] for c in checks] == [[1, 3, 6]] * 4
    assert [c["num_computed_tokens"] for c in checks[:3]] == [[2, 1, 3], [4, 2, 6], [6, 3, 9]]
    assert [c["ok"] for c in checks] == [True, True, True, False]
    assert checks[3]["message"] == str(info.value) and "num_computed_tokens" in checks[3]["message"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_riding_on_the_result_copy_catches_a_token_fault_within_one_step():
    """The last rank's way (runner.result): the token mirror records its ids for later, the
    snapshot records no event, then one result copy of the sampled ids is started, its host
    buffer attached to the token mirror and its PendingCopy shared with the check. Clean steps
    pass and make no copy / event of their own; a token id planted on the device is named within
    one step, with both ids."""
    from runtime.host_copy import HostCopy
    st = _state("cuda")
    tokens = st.track_tokens()
    chk = AsyncMirrorCheck(st)
    slots = np.array([1, 3, 6])
    slots_t = torch.as_tensor(slots, device="cuda")
    ones = torch.ones(3, dtype=torch.int64, device="cuda")
    copies = HostCopy(torch.device("cuda"))

    def step(n: int, planted: bool = False) -> None:
        _step(st)
        sampled = torch.tensor([[100 + n], [200 + n], [300 + n]], device="cuda")
        st.apply_sampled(slots_t, sampled, ones, torch.zeros_like(ones), slots.astype(np.int64),
                         np.zeros(3, dtype=np.int64), np.ones(3, dtype=np.int64),
                         tokens_later=True)
        if planted:
            st.all_token_ids[3, 2] += 5           # device only: slot 3, position 2 (a prompt id)
        chk.snapshot(n, later=True)
        copy = copies.start(sampled)
        tokens.attach(copy.host)
        chk.share(copy)

    for n in range(4):
        step(n)
    chk.poll(block=True)
    assert chk.checked_steps == 4 and not tokens.pending and not tokens._free
    assert tokens.ids_np[1, 6:10].tolist() == [100, 101, 102, 103]   # slot 1: 6 prompt ids
    step(4, planted=True)
    with pytest.raises(MirrorDivergence) as info:
        step(5)                                   # step 4's check is compared here
    e = info.value
    assert (e.rank, e.step, e.slot, e.req_id, e.field) == (1, 4, 3, "r3", "all_token_ids[2]")
    assert (e.cpu, e.device) == (2, 7)
