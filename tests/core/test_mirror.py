"""CPU mirrors: exact immediate / deferred updates, and divergence detection (invariant 4)."""

from __future__ import annotations

import numpy as np
import pytest

from ppstate.errors import MirrorDivergence
from ppstate.mirror import MIRROR_FIELDS, CpuMirror


def _mirror() -> CpuMirror:
    """Four slots: slot 0 prompt 10 (max 20), slot 2 prompt 3 (max 8); slots 1 and 3 unused."""
    m = CpuMirror(4, rank=1)
    m.add_request(0, prefill_len=10, max_seq_len=20)
    m.add_request(2, prefill_len=3, max_seq_len=8)
    return m


def _device(m: CpuMirror) -> dict[str, np.ndarray]:
    return {f: m.array(f).copy() for f in MIRROR_FIELDS}


def test_add_request_initialises_slot():
    m = _mirror()
    assert m.num_computed_tokens_np.tolist() == [0, 0, 0, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [0, 0, 0, 0]
    assert m.prefill_len_np.tolist() == [10, 0, 3, 0]
    assert m.max_seq_len_np.tolist() == [20, 0, 8, 0]


def test_add_request_resets_a_reused_slot():
    m = _mirror()
    m.apply_scheduled(np.array([2]), np.array([3]))
    m.add_request(2, prefill_len=5, max_seq_len=9)
    assert (m.num_computed_tokens_np[2], m.num_computed_prefill_tokens_np[2]) == (0, 0)
    assert (m.prefill_len_np[2], m.max_seq_len_np[2]) == (5, 9)


def test_apply_scheduled_chunk_then_final_chunk_then_decode():
    m = _mirror()
    m.apply_scheduled(np.array([0, 2]), np.array([4, 3]))       # chunk of 0, whole prompt of 2
    assert m.num_computed_tokens_np.tolist() == [4, 0, 3, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [4, 0, 3, 0]
    m.apply_scheduled(np.array([2, 0]), np.array([1, 6]))       # decode of 2, final chunk of 0
    assert m.num_computed_tokens_np.tolist() == [10, 0, 4, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [10, 0, 3, 0]
    m.apply_scheduled(np.array([0]), np.array([1]))
    assert m.num_computed_tokens_np.tolist() == [11, 0, 4, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [10, 0, 3, 0]


def test_apply_scheduled_caps_prefill_progress_at_prefill_len():
    m = _mirror()
    m.apply_scheduled(np.array([2]), np.array([5]))  # prompt 3 + 2 speculative tokens in one row
    assert (m.num_computed_tokens_np[2], m.num_computed_prefill_tokens_np[2]) == (5, 3)


def test_apply_scheduled_skips_minus_one_rows():
    m = _mirror()
    m.apply_scheduled(np.array([-1, 2, -1]), np.array([7, 2, 9]))
    assert m.num_computed_tokens_np.tolist() == [0, 0, 2, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [0, 0, 2, 0]


def test_apply_rejected_subtracts_and_skips_minus_one_rows():
    m = _mirror()
    m.apply_scheduled(np.array([0, 2]), np.array([10, 3]))
    m.apply_scheduled(np.array([0, 2]), np.array([3, 3]))
    m.apply_rejected(np.array([0, -1, 2]), np.array([2, 5, 0]))
    assert m.num_computed_tokens_np.tolist() == [11, 0, 6, 0]
    assert m.num_computed_prefill_tokens_np.tolist() == [10, 0, 3, 0]


def test_validate_passes_when_equal_and_ignores_dead_slots():
    m = _mirror()
    dev = _device(m)
    dev["num_computed_tokens"][1] = 99  # slot 1 is not live
    m.validate(dev, np.array([0, 2]), step=3)


@pytest.mark.parametrize("field", MIRROR_FIELDS)
def test_validate_names_field_slot_request_rank(field):
    m = _mirror()
    m.apply_scheduled(np.array([0, 2]), np.array([4, 3]))
    dev = _device(m)
    cpu_value = int(m.array(field)[2])
    dev[field][2] = cpu_value + 7
    owners = ["req-a", None, "req-b", None]
    with pytest.raises(MirrorDivergence) as info:
        m.validate(dev, np.array([0, 2]), step=12, owners=owners)
    err = info.value
    assert (err.rank, err.step, err.slot, err.req_id, err.field) == (1, 12, 2, "req-b", field)
    assert (err.cpu, err.device) == (cpu_value, cpu_value + 7)
    assert str(err) == (f"rank 1 step 12: mirror {field} of slot 2 (request 'req-b') is "
                        f"{cpu_value} on the CPU but {cpu_value + 7} on the device")


def test_validate_reports_first_field_and_first_slot():
    m = _mirror()
    dev = _device(m)
    dev["max_seq_len"][0] = 1
    dev["prefill_len"][2] = 1
    dev["prefill_len"][0] = 2
    with pytest.raises(MirrorDivergence) as info:
        m.validate(dev, np.array([0, 2]), step=0)
    assert (info.value.field, info.value.slot, info.value.req_id) == ("prefill_len", 0, None)


def test_validate_skips_fields_missing_from_device():
    m = _mirror()
    dev = {"num_computed_tokens": [0, 5, 0, 5]}
    m.validate(dev, np.array([0, 2]), step=1)
    dev["num_computed_tokens"][2] = 1
    with pytest.raises(MirrorDivergence, match="mirror num_computed_tokens of slot 2"):
        m.validate(dev, np.array([0, 2]), step=1)


def test_missed_immediate_update_is_caught():
    """The bug class mirrors exist for: a rank forgot to advance num_computed_tokens."""
    device, lagging = _mirror(), _mirror()
    device.apply_scheduled(np.array([0, 2]), np.array([4, 3]))
    with pytest.raises(MirrorDivergence) as info:
        lagging.validate(_device(device), np.array([0, 2]), step=5, owners=["a", None, "b", None])
    assert (info.value.field, info.value.slot, info.value.cpu, info.value.device) == (
        "num_computed_tokens", 0, 0, 4)


def test_validate_checks_fields_after_a_missing_one():
    """A field absent from the device mapping is skipped, not the end of the check."""
    m = _mirror()
    dev = {f: v.copy() for f, v in _device(m).items() if f != "num_computed_tokens"}
    dev["max_seq_len"][2] += 1
    with pytest.raises(MirrorDivergence, match="max_seq_len"):
        m.validate(dev, np.array([0, 2]), step=1)


def test_mirror_arrays_are_int64():
    m = _mirror()
    assert {f: m.array(f).dtype for f in MIRROR_FIELDS} == {f: np.dtype(np.int64) for f in MIRROR_FIELDS}
