"""KV cache of one simulated rank: its block table (built only from the scheduler's deltas) and
the token id each cache position holds, checked against the request's true sequence.

A row computing positions ``[start, start + n)`` writes the true token of each position into the
cells its block table names, then reads back positions ``0 .. start + n - 1`` through the same
table: any block shared when it should not be, reused while still referenced, missing, or a
prefix hit on the wrong content shows up as a mismatch (invariant 9). Positions past a request's
known sequence (optimistic rows after EOS) are written as unknown and not compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.block_digest import rank_deltas, row_digests

if TYPE_CHECKING:
    from ppstate.oracle.invariants import InvariantOracle

UNKNOWN = -2


class SimKV:
    """Block table ``[max_num_reqs, cols]`` and cell contents ``[num_blocks * block_size]``.

    Args:
        rank: PP rank (named in violations).
        max_num_reqs, max_model_len, num_blocks, block_size: geometry.
        checker: knows each request's true token sequence; records violations.
    """

    def __init__(self, rank: int, max_num_reqs: int, max_model_len: int, num_blocks: int,
                 block_size: int, checker: "InvariantOracle") -> None:
        self.rank, self.bs, self.checker = rank, block_size, checker
        cols = -(-max_model_len // block_size)
        self.table = np.zeros((max_num_reqs, cols), dtype=np.int64)   # [max_num_reqs, cols]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)      # [max_num_reqs]
        self.cells = np.full(num_blocks * block_size, -1, dtype=np.int64)  # [num_blocks * bs]

    def on_new(self, slot: int) -> None:
        """A request took ``slot``: its table row starts empty."""
        self.table[slot] = 0
        self.num_blocks[slot] = 0

    def apply_deltas(self, out: SchedulerOutput) -> None:
        """``table[slot, col] = id`` for each delta of the step."""
        s = out.block_table_slots.astype(np.int64)
        c = out.block_table_cols.astype(np.int64)
        self.table[s, c] = rank_deltas(self.rank, s, out.block_table_ids)  # ids (a mutant hook)
        np.maximum.at(self.num_blocks, s, c + 1)

    def check_block_ids(self, out: SchedulerOutput) -> None:
        """Block-id agreement (invariant 9), before the forward: the table row of every row's
        slot is the scheduler's decision (``out.block_digests``, the digest of the ids it gave
        the slot's request up to this step)."""
        if out.block_digests is None or out.num_rows == 0:
            return
        got = row_digests(self.table, self.num_blocks, out.slots)
        for i in np.flatnonzero(got != out.block_digests).tolist():
            slot = int(out.slots[i])
            self.checker.violation(9, out.step, self.rank, f"block ids of slot {slot} "
                                   f"({out.req_ids[i]}): rank table "
                                   f"{self.table[slot, :self.num_blocks[slot]].tolist()} differs "
                                   f"from the scheduler's (digest {int(got[i])} vs "
                                   f"{int(out.block_digests[i])})", slot=slot,
                                   req_id=out.req_ids[i])

    def forward(self, out: SchedulerOutput, starts: np.ndarray | None = None,
                inputs: np.ndarray | None = None, num_drafts: np.ndarray | None = None) -> None:
        """Write every row's positions, then read each row's whole context back and compare
        (vectorised over the rows of the step).

        With speculative decoding (:mod:`ppstate.sim.spec_rank`): ``starts`` ``[num_rows]`` are
        the rank's own start positions, ``inputs`` ``[num_rows, K + 1]`` the rows' input ids and
        ``num_drafts`` ``[num_rows]`` their drafts; a row writes its drafts at ``start + 1 ..
        start + k`` and reads back positions ``0 .. start`` only (its committed context: the
        accepted tokens, which a rank that kept a rejected draft's position no longer has)."""
        if out.num_rows == 0:
            return
        slots = out.slots.astype(np.int64)
        start = out.start_positions.astype(np.int64) if starts is None else starts
        end = start + out.num_scheduled_tokens
        short = np.nonzero(-(-end // self.bs) > self.num_blocks[slots])[0]
        for i in short.tolist():
            self.checker.violation(9, out.step, self.rank, f"{out.req_ids[i]} computes up to "
                                   f"position {int(end[i])} but holds "
                                   f"{int(self.num_blocks[slots[i]])} blocks",
                                   slot=int(slots[i]), req_id=out.req_ids[i])
        ok = np.ones(out.num_rows, dtype=bool)
        ok[short] = False
        truths = [self.checker.true_sequence(rid) for rid in out.req_ids]
        w_slot, w_pos, w_val, r_slot, r_pos, r_val, r_row = [], [], [], [], [], [], []
        for i in np.nonzero(ok)[0].tolist():
            truth, pos = truths[i], np.arange(start[i], end[i])
            w_slot.append(np.full(pos.size, slots[i]))
            w_pos.append(pos)
            val = np.where(pos < truth.size, truth[np.minimum(pos, truth.size - 1)], UNKNOWN)
            nd = 0 if num_drafts is None else int(num_drafts[i])
            if nd:
                val[1:nd + 1] = inputs[i, 1:nd + 1]
            w_val.append(val)
            n = min(int(end[i]) - nd, truth.size)
            r_slot.append(np.full(n, slots[i]))
            r_pos.append(np.arange(n))
            r_val.append(truth[:n])
            r_row.append(np.full(n, i))
        if not w_slot:
            return
        self.cells[self._index(np.concatenate(w_slot), np.concatenate(w_pos))] = np.concatenate(w_val)
        pos = np.concatenate(r_pos)
        got = self.cells[self._index(np.concatenate(r_slot), pos)]
        want = np.concatenate(r_val)
        bad = np.nonzero((got != want) & (got != UNKNOWN))[0]
        if bad.size:
            k = int(bad[0])
            i, p = int(np.concatenate(r_row)[k]), int(pos[k])
            self.checker.violation(9, out.step, self.rank, f"{out.req_ids[i]} reads {int(got[k])} "
                                   f"at position {p} (block {int(self.table[slots[i], p // self.bs])}"
                                   f"), its token is {int(want[k])}", slot=int(slots[i]),
                                   req_id=out.req_ids[i])

    def _index(self, slots: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Flat cell of each position; an id past the pool (a wrong table, already reported by
        :meth:`check_block_ids`) reads and writes the last block."""
        blocks = np.minimum(self.table[slots, pos // self.bs], self.cells.size // self.bs - 1)
        return blocks * self.bs + pos % self.bs
