"""Block ids in the canonical form: the block-id agreement (invariant 9) without block identity.

:func:`ppstate.check.renumber.rename_blocks` zeroes the block ids of the in-flight outputs'
deltas (which free block a request got is not part of the future: every rank applies the same
deltas). The ranks' block tables (:class:`~ppstate.check.rank.CheckRank`), the scheduler's copy
of the rows it decided (:class:`~ppstate.block_digest.BlockDigests`) and the outputs' per-row
digests are then rewritten as if every id so far had been 0: each digest becomes the digest of
``count`` zero ids, which depends on the row's block count only. Ids issued later are real
again on both sides, so a rank that applies them wrongly (mutant ``rank_local_block_shift``) still
disagrees with the digest of the step that carries them.

An in-flight output's row count is the one its slot has when a rank runs it: replayed from the
rank furthest behind (its mirror's block counts, then the admissions and deltas of each output
from its next step on); outputs every rank has run keep no digest (nothing reads it again).
"""

from __future__ import annotations

import numpy as np

from ppstate.block_digest import row_digests
from ppstate.check.renumber import _outputs


def zero_block_ids(w) -> None:
    """Rewrite ``w``'s block ids and digests as described in the module docstring."""
    sched = w.sched
    dig = sched.kv.digests
    n = dig.num_blocks.size
    free = np.array([o is None for o in sched.slots.owner], dtype=bool)
    dig.num_blocks[free] = 0
    dig.table[:] = 0
    dig.values[:] = row_digests(dig.table, dig.num_blocks, np.arange(n))
    for rk in w.ranks:
        rk.block_table[:] = 0
        rk.block_error = None
    behind = min(w.ranks, key=lambda rk: rk.next_step)
    counts = behind.mirror.num_blocks_np.copy()                 # [max_num_reqs]
    zeros = dig.table
    for out in sorted(_outputs(w), key=lambda o: o.step):
        if out.block_digests is None:
            continue
        if out.step < behind.next_step:
            object.__setattr__(out, "block_digests", None)
            continue
        for nr in out.new_requests:
            counts[nr.slot] = 0
        if out.block_table_slots.size:
            np.maximum.at(counts, out.block_table_slots.astype(np.int64),
                          out.block_table_cols.astype(np.int64) + 1)
        object.__setattr__(out, "block_digests", row_digests(zeros, counts, out.slots))
