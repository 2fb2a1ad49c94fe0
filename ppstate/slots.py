"""Slot table: the fixed-size rows (``max_num_reqs``) that live requests occupy.

Mirrors vLLM v1 ``worker/gpu`` request states: slot-indexed numpy arrays plus a free list. The
slot machine is ``specs/slot.yaml`` (free -> allocated -> free); freeing bumps the slot's
generation counter, which is how stale deferred outputs are recognised (invariant 2). The table's
effects are methods of :class:`SlotTable` (``bump_generation``), bound when the first table is
built (:func:`ppstate.table_binding.bind_effects`) and run by :meth:`SlotTable.free`.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ppstate.errors import SlotError
from ppstate.state_tables import load_table
from ppstate.table_binding import bind_effects, to_machine


class SlotTable:
    """Free list + ``req_id -> slot`` map + per-slot generation counters.

    Args:
        max_num_reqs: number of slots (rows of every per-request state array).
    """

    def __init__(self, max_num_reqs: int) -> None:
        if max_num_reqs <= 0:
            raise SlotError(f"max_num_reqs must be positive, got {max_num_reqs}")
        _effects()   # the table is bound to this class (TableError at the first table otherwise)
        self.max_num_reqs = max_num_reqs
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self.owner: list[str | None] = [None] * max_num_reqs       # [max_num_reqs]
        # Lowest index first, so runs are reproducible and small batches use low slots.
        self._free: list[int] = list(range(max_num_reqs - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        return len(self._slot_of)

    def allocate(self, req_id: str) -> int:
        """Give ``req_id`` a free slot and return its index.

        Raises:
            SlotError: no free slot, or ``req_id`` already holds one.
        """
        if req_id in self._slot_of:
            raise SlotError(f"request {req_id!r} already holds slot {self._slot_of[req_id]}")
        if not self._free:
            raise SlotError(f"no free slot for request {req_id!r} (all {self.max_num_reqs} in use)")
        idx = self._free.pop()
        self._slot_of[req_id] = idx
        self.owner[idx] = req_id
        return idx

    def free(self, req_id: str) -> int:
        """Release ``req_id``'s slot, bump its generation and return the slot index.

        Raises:
            SlotError: ``req_id`` holds no slot (unknown request or double free).
        """
        idx = self._slot_of.pop(req_id, None)
        if idx is None:
            raise SlotError(f"request {req_id!r} holds no slot (unknown request or double free)")
        self.owner[idx] = None
        for name in _effects()["release"]:   # specs/slot.yaml: bump_generation
            getattr(self, name)(idx)
        self._free.append(idx)
        return idx

    def bump_generation(self, idx: int) -> None:
        """Effect of ``release``: slot ``idx``'s generation += 1 (its deferred rows go stale)."""
        self.generation[idx] += 1

    def lookup(self, req_id: str) -> int | None:
        """Slot of ``req_id``, or None if it holds none."""
        return self._slot_of.get(req_id)

    def live_slots(self) -> np.ndarray:
        """Indices of allocated slots, ascending. Shape ``[num_allocated]``, int64."""
        return np.fromiter(sorted(self._slot_of.values()), dtype=np.int64)


@lru_cache(maxsize=None)
def _effects() -> dict[str, tuple[str, ...]]:
    """trigger -> effect methods of :class:`SlotTable`, from ``specs/slot.yaml`` (checked once
    per process; its machine is built too, validating the edges)."""
    table = load_table("slot")
    to_machine(table)
    return {"release": (), **bind_effects(table, SlotTable)}
