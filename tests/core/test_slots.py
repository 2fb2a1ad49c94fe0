"""Slot table: allocate / free / lookup, generation counters, and every misuse error."""

from __future__ import annotations

import numpy as np
import pytest

from ppstate.errors import SlotError
from ppstate.slots import SlotTable


def test_allocate_gives_lowest_free_slots_in_order():
    t = SlotTable(3)
    assert [t.allocate("a"), t.allocate("b"), t.allocate("c")] == [0, 1, 2]
    assert t.owner == ["a", "b", "c"]
    assert (t.num_free, t.num_allocated) == (0, 3)
    assert t.live_slots().tolist() == [0, 1, 2]
    assert t.live_slots().dtype == np.int64


def test_lookup_returns_slot_or_none():
    t = SlotTable(2)
    t.allocate("a")
    t.allocate("b")
    assert (t.lookup("a"), t.lookup("b"), t.lookup("zz")) == (0, 1, None)


def test_free_bumps_generation_and_releases_slot():
    t = SlotTable(3)
    for r in "abc":
        t.allocate(r)
    assert t.free("b") == 1
    assert t.generation.tolist() == [0, 1, 0]
    assert t.owner == ["a", None, "c"]
    assert t.lookup("b") is None
    assert (t.num_free, t.num_allocated) == (1, 2)
    assert t.live_slots().tolist() == [0, 2]


def test_freed_slot_is_reused_and_generation_keeps_counting():
    t = SlotTable(2)
    t.allocate("a")
    t.allocate("b")
    t.free("a")
    assert t.allocate("c") == 0
    assert t.owner == ["c", "b"]
    t.free("c")
    t.free("b")
    assert t.generation.tolist() == [2, 1]
    assert t.live_slots().tolist() == []


def test_double_free_raises():
    t = SlotTable(2)
    t.allocate("a")
    t.free("a")
    with pytest.raises(SlotError) as info:
        t.free("a")
    assert str(info.value) == "request 'a' holds no slot (unknown request or double free)"
    assert t.generation.tolist() == [1, 0]


def test_free_unknown_request_raises():
    t = SlotTable(2)
    with pytest.raises(SlotError, match="request 'ghost' holds no slot"):
        t.free("ghost")
    assert t.generation.tolist() == [0, 0]
    assert t.num_free == 2


def test_no_free_slot_raises():
    t = SlotTable(1)
    t.allocate("a")
    with pytest.raises(SlotError) as info:
        t.allocate("b")
    assert str(info.value) == "no free slot for request 'b' (all 1 in use)"
    assert t.lookup("b") is None
    assert t.owner == ["a"]


def test_duplicate_allocate_raises():
    t = SlotTable(3)
    t.allocate("x")
    t.allocate("a")
    with pytest.raises(SlotError) as info:
        t.allocate("a")
    assert str(info.value) == "request 'a' already holds slot 1"
    assert (t.num_free, t.num_allocated) == (1, 2)


@pytest.mark.parametrize("size", [0, -3])
def test_non_positive_size_raises(size):
    with pytest.raises(SlotError, match=f"max_num_reqs must be positive, got {size}"):
        SlotTable(size)
