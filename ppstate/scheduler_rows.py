"""Builds the rows of one step for :class:`ppstate.scheduler.Scheduler` (through the narrow
:class:`RowSource` protocol, so this module does not import the scheduler).

Order of priority inside a step: eligible decode rows (oldest eligibility first), then continuing
prefill chunks, then FCFS admission of waiting requests while slots, tokens and the row cap allow.
Every row updates the slot-indexed progress arrays at once (optimistic scheduling: the step's
result is not needed to schedule the next rows of a request), and takes the KV blocks for the
tokens it computes. A decode or continuing chunk that finds no free block preempts the youngest
running request without a row in this step (possibly itself); after a preemption no request is
admitted in the same step. Admission keeps ``watermark_blocks`` free.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ppstate.batch import NewRequest, SchedulerOutput, FreedSlot
from ppstate.budget import RequestArrays, SchedulerConfig, StepBudget
from ppstate.chunk_sizing import chunk_limit
from ppstate.kv_manager import KVManager
from ppstate.lanes import lane_open
from ppstate.request import Request
from ppstate.spec_decode import drafts_for_row
from ppstate.slots import SlotTable


class RowSource(Protocol):
    """What :class:`RowBuilder` needs of the scheduler (:class:`ppstate.scheduler.Scheduler` is
    one; the queue operations are :class:`ppstate.scheduler_queues.QueueOps`).

    Attributes:
        config: budgets, pp_size, mode.
        arrays: per-slot progress (``[max_num_seqs]`` int64 each), updated in place per row.
        kv: the KV-cache manager (blocks taken per row).
        slots: the slot table (free slots bound admission).
        lanes: lanes filled with decode rows this step (:mod:`ppstate.lanes`).
        num_prefill_tokens: prefill tokens scheduled so far (the builder adds to it).
    """
    config: SchedulerConfig
    arrays: RequestArrays
    kv: KVManager
    slots: SlotTable
    lanes: int
    num_prefill_tokens: int

    def running_requests(self) -> list[Request]: ...
    def pop_waiting(self) -> Request | None: ...
    def peek_waiting(self) -> Request | None: ...
    def youngest_running(self, exclude: set[str]) -> Request | None: ...
    def preempt(self, req: Request) -> None: ...
    def place(self, req: Request, step: int, hit: list[int]) -> NewRequest: ...
    def fire(self, req: Request, trigger: str) -> None: ...


class RowBuilder:
    """Collects the rows of step ``step`` within ``budget``.

    Args:
        sched: the scheduler, as a :class:`RowSource` (its arrays, slots and lifecycle are updated
            in place).
        step: the step being built.
        budget: tokens and rows left in this step.
    """

    def __init__(self, sched: RowSource, step: int, budget: StepBudget) -> None:
        self.sched, self.step, self.budget = sched, step, budget
        self.arrays = sched.arrays
        self.cadence = sched.config.cadence
        self.req_ids: list[str] = []
        self.slots: list[int] = []
        self.num_scheduled_tokens: list[int] = []
        self.starts: list[int] = []
        self.final: list[bool] = []
        self.new: list[NewRequest] = []
        self.epochs: list[int] = []          # [num_rows] admission epoch of each row's request
        self.drafts: list[int] = []          # [num_rows] speculative drafts of each row (decode)
        self.kv = sched.kv
        self.preempted = False

    def _row(self, req: Request, num_scheduled_tokens: int, final: bool, counts_row: bool = True,
             outputs: int = 1) -> None:
        a, slot = self.arrays, req.slot
        self.req_ids.append(req.req_id)
        self.slots.append(slot)
        self.num_scheduled_tokens.append(num_scheduled_tokens)
        self.starts.append(int(a.num_computed_tokens[slot]))
        self.final.append(final)
        self.epochs.append(req.epoch)
        self.drafts.append(outputs - 1 if req.state == "decoding" else 0)
        if req.state == "prefilling":
            self.sched.num_prefill_tokens += num_scheduled_tokens
        a.num_computed_tokens[slot] += num_scheduled_tokens
        self.kv.grow(req, int(a.num_computed_tokens[slot]))
        self.kv.register_full(req, int(a.num_computed_tokens[slot]))
        if final:
            a.num_sampling_rows[slot] += outputs  # 1 + drafts: optimistic, see on_step_result
            a.next_eligible_step[slot] = self.step + self.cadence
        else:
            a.next_eligible_step[slot] = self.step + 1
        self.budget.take(num_scheduled_tokens, counts_row)

    def add_decodes(self) -> None:
        """Rows for decoding requests that are eligible and below max_tokens (optimistic outputs):
        one token each, or with speculative decoding ``1 + k`` (the last sampled token and ``k``
        drafts, :meth:`_decode_tokens`)."""
        a = self.arrays
        if not lane_open(self.step, self.sched.lanes, self.sched.config.pp_size):
            return  # adaptive lanes (ppstate.lanes): this step's lane takes no decode rows
        running = [r for r in self.sched.running_requests() if r.state == "decoding"]
        if not running:
            return
        slots = np.fromiter((r.slot for r in running), dtype=np.int64, count=len(running))
        ok = (a.next_eligible_step[slots] <= self.step) & \
            (a.num_sampling_rows[slots] < a.max_tokens[slots])               # [num_decoding]
        picked = np.nonzero(ok)[0]
        order = picked[np.argsort(a.next_eligible_step[slots[picked]], kind="stable")]
        k_max = self.sched.config.num_spec_tokens
        fast: list[int] = []   # slots of rows whose token fits a block the request holds
        table, bs = self.kv.pool.table, self.kv.block_size
        for i in order.tolist():
            if not self.budget.can_add():
                break
            req = running[i]
            if req.slot < 0:  # preempted earlier in this loop
                continue
            if k_max:  # speculative decoding (#14): the last token plus k drafts
                if (got := self._room(req, self._decode_tokens(req))) >= 1:
                    self._row(req, got, True, outputs=got)
                continue
            computed = int(a.num_computed_tokens[req.slot])
            if computed < len(table(req.req_id)) * bs:  # no new block, nothing to register
                self._decode_row(req, computed)
                fast.append(req.slot)
            elif self._room(req, 1) == 1:
                self._row(req, 1, True)
        if fast:  # the per-slot effects of _row for the fast rows, in bulk (slots are distinct)
            idx = np.asarray(fast, dtype=np.int64)
            a.num_computed_tokens[idx] += 1
            a.num_sampling_rows[idx] += 1
            a.next_eligible_step[idx] = self.step + self.cadence

    def _decode_row(self, req: Request, computed: int) -> None:
        """A one-token decode row of ``req`` whose position ``computed`` lies in a KV block it
        already holds (:meth:`_row` without the block work; the caller updates the arrays)."""
        self.req_ids.append(req.req_id)
        self.slots.append(req.slot)
        self.num_scheduled_tokens.append(1)
        self.starts.append(computed)
        self.final.append(True)
        self.epochs.append(req.epoch)
        self.drafts.append(0)
        self.budget.tokens -= 1
        self.budget.rows -= 1

    def _decode_tokens(self, req: Request) -> int:
        """Tokens of ``req``'s decode row: 1, plus ``k`` speculative drafts when
        ``num_spec_tokens`` > 0. ``k`` is capped by the outputs the request may still produce
        (optimistic count, so an accepted run never passes max_tokens / max_seq_len: no early
        finish, no position past the slot's KV) and by the step's token budget."""
        k_max = self.sched.config.num_spec_tokens
        if k_max == 0:
            return 1
        a = self.arrays
        room = int(a.max_tokens[req.slot] - a.num_sampling_rows[req.slot]) - 1
        return 1 + drafts_for_row(room, k_max, self.budget.tokens)

    def _room(self, req: Request, want: int) -> int:
        """Tokens (<= want, >= 1 unless 0) of ``req``'s next row the KV blocks can hold, preempting
        the youngest running request without a row in this step while none fit (0: ``req``
        itself was preempted or no victim is left)."""
        computed = int(self.arrays.num_computed_tokens[req.slot])
        while (fit := self.kv.tokens_fit(req, computed, want)) < 1:
            victim = self.sched.youngest_running(set(self.req_ids))
            if victim is None:
                return 0
            self.sched.preempt(victim)
            self.preempted = True
            if victim is req:
                return 0
        return fit

    def _add_chunk(self, req: Request, counts_row: bool, fit: int | None = None) -> None:
        a, slot = self.arrays, req.slot
        remaining = int(a.prefill_len[slot] - a.num_computed_tokens[slot])
        limit = chunk_limit(self.sched.config, int(a.num_computed_tokens[slot]))  # issue 11
        chunk = min(remaining, limit, self.budget.tokens)
        chunk = self._room(req, chunk) if fit is None else min(chunk, fit)
        if chunk < 1:
            return
        final = chunk == remaining
        self._row(req, chunk, final, counts_row)
        if final:
            self.sched.fire(req, "complete_prefill")

    def add_continuing_prefills(self) -> None:
        """Next chunk of every admitted request still prefilling (consecutive steps).

        These rows use tokens but not the balanced row share: a long prompt occupies consecutive
        steps for a while and must not block admissions (its lane is only chosen by its final
        chunk).
        """
        for req in self.sched.running_requests():
            if req.slot >= 0 and req.state == "prefilling" and \
                    self.arrays.next_eligible_step[req.slot] <= self.step:
                if self.budget.tokens <= 0:
                    return
                self._add_chunk(req, counts_row=False)

    def admit_waiting(self) -> None:
        """FCFS admission into free slots while the first chunk fits the free KV blocks (minus the
        watermark); a prefix-cache hit starts the chunk at the first uncached token. Nothing is
        admitted in a step that preempted."""
        while not self.preempted and self.budget.can_add() and self.sched.slots.num_free > 0:
            req = self.sched.peek_waiting()
            if req is None:
                return
            hit = self.kv.prefix_hit(req)
            remaining = len(req.prefill_tokens) - len(hit) * self.kv.block_size
            limit = chunk_limit(self.sched.config, len(hit) * self.kv.block_size)  # issue 11
            chunk = min(remaining, limit, self.budget.tokens)
            fit = self.kv.admissible_tokens(hit, chunk)
            if fit < 1:
                return  # FCFS: the head waits for blocks
            self.sched.pop_waiting()
            self.new.append(self.sched.place(req, self.step, hit))
            self._add_chunk(req, counts_row=True, fit=fit)

    def build(self, freed: tuple[FreedSlot, ...],
              deltas: tuple[np.ndarray, np.ndarray, np.ndarray]) -> SchedulerOutput:
        """The step's SchedulerOutput (arrays ``[num_rows]``; block-table deltas ``[U]``)."""
        return SchedulerOutput(
            step=self.step, req_ids=tuple(self.req_ids),
            slots=np.array(self.slots, dtype=np.int32),                 # [num_rows]
            num_scheduled_tokens=np.array(self.num_scheduled_tokens, dtype=np.int32),   # [num_rows]
            start_positions=np.array(self.starts, dtype=np.int32),      # [num_rows]
            is_final_chunk=np.array(self.final, dtype=bool),            # [num_rows]
            new_requests=tuple(self.new), freed=freed, block_table_slots=deltas[0],
            block_table_cols=deltas[1], block_table_ids=deltas[2])
