"""Per-slot digests of KV block-table rows: the scheduler's decision, checked on every rank.

Every rank builds its block table from the scheduler's deltas (``SchedulerOutput.block_table_*``)
and a step reads it for every row (attention reads and KV writes go through it). A rank whose
table is wrong reads another request's KV or writes into a shared prefix block, silently: the
count of blocks per slot is mirrored (``CpuMirror.num_blocks``), the ids are not. So the
scheduler sends, with each step, the digest of the block ids it decided for each row's slot
(:attr:`~ppstate.batch.SchedulerOutput.block_digests`, ``[num_rows]`` int64), and every rank
compares it with the digest of its own table rows before the forward
(:func:`check_row_digests`), which also catches a rank whose CPU and device copies are both wrong.

The digest of a row holding blocks ``b_0 .. b_{n-1}`` is ``n * W_0 + sum(b_c * W_{c+1}) mod
2**64`` (viewed as int64), ``W_i`` fixed odd 64-bit constants (splitmix64 of ``i``). Columns past
``n`` hold 0 on a healthy rank (a row starts empty on admission), so a rank computes the digests of
its step's rows from its table with one multiply-and-sum over the step's widest row, no mask
(:func:`row_digests`); the scheduler recomputes it for the slots a step's deltas touch
(:class:`BlockDigests`). Any single changed id, any changed count and any shift of a row change the
digest (``W_i`` odd: ``delta * W_i != 0 mod 2**64`` for ``0 < |delta| < 2**63``), and so does a
non-zero entry past the count; two different rows collide only by a 64-bit coincidence.

Mutant ``rank_local_block_shift`` (:mod:`ppstate.mutants`): :func:`rank_deltas` adds 1 to the
block ids of the first slot of a step's deltas on rank 1 only (a rank-local table error).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ppstate import mutants
from ppstate.errors import MirrorDivergence

_MASK = (1 << 64) - 1
_weights = np.zeros(0, dtype=np.uint64)   # [cols] grown on demand, shared by every caller


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def column_weights(n: int) -> np.ndarray:
    """``[n]`` uint64 odd weights ``W_0 .. W_{n-1}`` (the same in every process)."""
    global _weights
    if _weights.size < n:
        size = max(n, 2 * _weights.size, 64)
        _weights = np.array([_splitmix64(c) | 1 for c in range(size)], dtype=np.uint64)
    return _weights[:n]


def digest_of(block_ids: Sequence[int]) -> int:
    """The digest (int64) of one row holding ``block_ids`` in columns 0, 1, ...; a reference
    for tests and the checker (pure Python ints)."""
    w = column_weights(len(block_ids) + 1)
    total = (len(block_ids) * int(w[0]) +
             sum(int(b) * int(w[c + 1]) for c, b in enumerate(block_ids))) & _MASK
    return total - (1 << 64) if total >= 1 << 63 else total


class BlockDigests:
    """Scheduler side: each slot's block-table row as decided so far, and its digest.

    The rows are kept exactly as every rank builds them from the deltas (a row starts empty on
    admission; ``table[slot, col] = id``, the last write of a column wins; ``num_blocks =
    max(num_blocks, col + 1)``), so the digests are the ones a correct rank computes.

    Args:
        max_num_reqs: slots.
        max_blocks_per_slot: columns (``ceil(max_model_len / block_size)``).

    Attributes:
        table: ``[max_num_reqs, max_blocks_per_slot]`` int64 block ids.
        num_blocks: ``[max_num_reqs]`` int64 blocks per row.
        values: ``[max_num_reqs]`` int64 digest per slot.
    """

    def __init__(self, max_num_reqs: int, max_blocks_per_slot: int) -> None:
        self.table = np.zeros((max_num_reqs, max_blocks_per_slot), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)   # [max_num_reqs]
        self.values = np.zeros(max_num_reqs, dtype=np.int64)       # [max_num_reqs]

    def apply(self, new_slots: Sequence[int], slots: np.ndarray, cols: np.ndarray,
              ids: np.ndarray) -> None:
        """One step's decision, in the order every rank applies it: the admitted slots' rows
        start empty, then the deltas ``table[slots[u], cols[u]] = ids[u]`` (``[U]`` each)."""
        if len(new_slots):
            new = np.asarray(new_slots, dtype=np.int64)
            self.table[new] = 0
            self.num_blocks[new] = 0
            self.values[new] = 0
        if not slots.size:
            return
        s, c = slots.astype(np.int64), cols.astype(np.int64)
        self.table[s, c] = ids
        if len(new_slots):   # a slot may be written twice (a stale delta, then its new owner's)
            np.maximum.at(self.num_blocks, s, c + 1)
            touched = np.unique(s)
            self.values[touched] = row_digests(self.table, self.num_blocks, touched)
            return
        # no admission: every delta appends a new column to a running row (each written once),
        # so each adds its own term, and the count term grows with the count
        before = self.num_blocks.copy()
        np.maximum.at(self.num_blocks, s, c + 1)
        w = column_weights(int(c.max()) + 2)
        v = self.values.view(np.uint64)
        v += (self.num_blocks - before).astype(np.uint64) * w[0]
        np.add.at(v, s, ids.astype(np.uint64) * w[c + 1])

    def of(self, slots: np.ndarray) -> np.ndarray:
        """``[num_rows]`` int64 digests of the rows' slots (a copy)."""
        return self.values[slots.astype(np.int64)]


def row_digests(table: np.ndarray, num_blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Rank side: ``[num_rows]`` int64 digests of ``table[slot, :num_blocks[slot]]`` per row.

    Args:
        table: ``[max_num_reqs, cols]`` block ids (int32 or int64).
        num_blocks: ``[max_num_reqs]`` blocks per slot (the rank's mirror).
        slots: ``[num_rows]`` slot per row.
    """
    nb = num_blocks.take(slots)                                # [num_rows]
    k = int(nb.max()) if nb.size else 0
    w = column_weights(k + 1).view(np.int64)   # int64 products wrap mod 2**64 as uint64's do
    d = nb * w[0]                                               # [num_rows]
    if k:   # one gather of the rows' used columns and one integer matrix-vector product
        d += np.dot(table[:, :k].take(slots, axis=0), w[1:])
    return d


def check_row_digests(table: np.ndarray, num_blocks: np.ndarray, slots: np.ndarray,
                      expected: np.ndarray | None, step: int, rank: int | None,
                      owners: Sequence[str | None] | None = None) -> None:
    """Compare the rank's table rows of a step with the scheduler's digests (before the forward).

    Args:
        table, num_blocks, slots: as :func:`row_digests`.
        expected: ``[num_rows]`` int64 :attr:`SchedulerOutput.block_digests`, or None (an
            output built without a scheduler, e.g. by hand in a test: nothing to compare).
        step, rank, owners: named in the error (``owners``: ``[max_num_reqs]`` req id per slot).

    Raises:
        MirrorDivergence: field ``block_ids (digest vs scheduler)``, ``cpu`` = the rank's
            digest, ``device`` = the scheduler's.
    """
    if expected is None or slots.size == 0:
        return
    got = row_digests(table, num_blocks, slots)
    if got.tobytes() == np.ascontiguousarray(expected, dtype=np.int64).tobytes():
        return   # one memcmp on the common path
    bad = np.flatnonzero(got != expected)
    if bad.size:
        i = int(bad[0])
        slot = int(slots[i])
        raise MirrorDivergence(step=step, slot=slot, field="block_ids (digest vs scheduler)",
                               req_id=owners[slot] if owners is not None else None,
                               cpu=int(got[i]), device=int(expected[i]), rank=rank)


def rank_deltas(rank: int, slots: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The block ids a rank writes for a step's deltas: ``ids`` itself, or under mutant
    ``rank_local_block_shift`` on rank 1, ids + 1 for the deltas of the first slot."""
    if mutants.active("rank_local_block_shift") and rank == 1 and slots.size:
        ids = ids + (slots == slots[0]).astype(ids.dtype)
    return ids
