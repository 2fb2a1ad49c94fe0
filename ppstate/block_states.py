"""KV block state machine built from ``specs/block.yaml``, applied to arrays of blocks at once.

A ``transitions.Machine`` is built from the table (as :mod:`ppstate.lifecycle` does for requests);
from its events we derive, per trigger, a boolean "allowed source" vector and a destination vector
indexed by state code. :meth:`BlockStates.fire` then moves a whole numpy array of block ids along
one edge with two vectorised lookups, raising :class:`~ppstate.errors.BlockError` if any block is
in a state that has no such edge. The guard (``is_hashed``) is a method of the caller,
:class:`ppstate.blocks.BlockPool`, which owns the hashes (checked when a pool is built); the
effects (reference counts, free list, LRU, hash) are applied by the pool on arrays of blocks.
"""

from __future__ import annotations

import numpy as np

from ppstate.errors import BlockError
from ppstate.state_tables import MachineTable, load_table
from ppstate.table_binding import to_machine

FREE, ALLOCATED, CACHED = 0, 1, 2
STATE_NAMES = ("free", "allocated", "cached")


class BlockStates:
    """State code per block (``[num_blocks]`` int8: 0 free, 1 allocated, 2 cached) and the edges.

    Args:
        num_blocks: blocks in the pool.
        table: the machine table; defaults to ``specs/block.yaml``.
    Raises:
        BlockError: the table's states differ from ``free / allocated / cached``.
    """

    def __init__(self, num_blocks: int, table: MachineTable | None = None) -> None:
        self.table = table or load_table("block")
        if tuple(self.table.state_names) != STATE_NAMES:
            raise BlockError(f"specs/block.yaml must have states {STATE_NAMES}, "
                             f"got {self.table.state_names}")
        self.machine = to_machine(self.table)   # model=None: a validated edge table
        self.code = np.full(num_blocks, FREE, dtype=np.int8)  # [num_blocks]
        self._allowed: dict[str, np.ndarray] = {}
        self._dest: dict[str, np.ndarray] = {}
        for trigger, event in self.machine.events.items():
            allowed = np.zeros(len(STATE_NAMES), dtype=bool)   # [num_states]
            dest = np.arange(len(STATE_NAMES), dtype=np.int8)  # [num_states]
            for source, edges in event.transitions.items():
                i = STATE_NAMES.index(source)
                allowed[i] = True
                dest[i] = STATE_NAMES.index(edges[0].dest or source)
            self._allowed[trigger], self._dest[trigger] = allowed, dest
        self._forbidden = {t: ~a for t, a in self._allowed.items()}  # [num_states] each

    @property
    def triggers(self) -> tuple[str, ...]:
        return tuple(self._allowed)

    def fire(self, blocks: np.ndarray | list[int], trigger: str) -> None:
        """Move every block of ``blocks`` (``[n]`` ids) along ``trigger``.

        Raises:
            BlockError: unknown trigger, or some block's state has no ``trigger`` edge (names the
                first such block and its state); no block is changed then.
        """
        forbidden = self._forbidden.get(trigger)
        if forbidden is None:
            raise BlockError(f"unknown block trigger {trigger!r}; known: {self.triggers}")
        ids = np.asarray(blocks, dtype=np.int64)
        cur = self.code[ids].astype(np.intp)   # intp: indexing with int8 is several times slower
        bad = forbidden[cur]
        if np.count_nonzero(bad):
            i = int(np.argmax(bad))
            raise BlockError(f"block {int(ids[i])} in state {STATE_NAMES[cur[i]]!r} cannot take "
                             f"trigger {trigger!r}")
        self.code[ids] = self._dest[trigger][cur]

    def count(self, state: int) -> int:
        """Blocks currently in ``state`` (a state code)."""
        return int(np.count_nonzero(self.code == state))
