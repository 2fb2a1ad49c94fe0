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
