"""Builds the rows of one step for :class:`ppstate.scheduler.Scheduler`, from the objects the
scheduler owns (its queues, slot views, progress arrays, KV manager), given as fields: this module
does not import the scheduler.

Order of priority inside a step: eligible decode rows (oldest eligibility first), then continuing
prefill chunks, then FCFS admission of waiting requests while slots, tokens and the row cap allow.
Every row updates the slot-indexed progress arrays at once (optimistic scheduling: the step's
result is not needed to schedule the next rows of a request), and takes the KV blocks for the
tokens it computes. A decode or continuing chunk that finds no free block preempts the youngest
running request without a row in this step (possibly itself); after a preemption no request is
admitted in the same step. Admission keeps ``watermark_blocks`` free.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ppstate.batch import NewRequest, SchedulerOutput, FreedSlot
from ppstate.block_digest import BlockDigests
from ppstate.budget import RequestArrays, SchedulerConfig, StepBudget
from ppstate.chunk_sizing import chunk_limit
from ppstate.kv_manager import KVManager
from ppstate.request import Request
from ppstate.scalars import ONE_I64
from ppstate.scheduler_queues import RequestQueues
from ppstate.scheduler_results import gather
from ppstate.slot_views import SlotViews
from ppstate.speculative import drafts_for_row
from ppstate.speculative_probe import NgramProbe


_ONES = np.ones(4096, dtype=np.int64)   # tokens / final columns of decode rows (never written)
_ONES.flags.writeable = False


class RowBuilder:
    """Collects the rows of step ``step`` within ``budget``.

    Rows are kept as column parts (``[n]`` arrays each: slot, tokens, start, final, epoch,
    drafts): runs of one-token decode rows are added with array operations, other rows one by
    one (:meth:`_row`); :meth:`build` concatenates the parts in row order.

    Args:
        config: budgets, pp_size, mode, speculative tokens.
        arrays: per-slot progress (``[max_num_seqs]`` int64 each), updated in place per row.
        kv: the KV-cache manager (blocks taken per row).
        views: the slot-indexed views (``decoding`` is set here when ``complete_prefill`` fires).
        queues: the request queues (admission, preemption; their slot table bounds admission).
        fire: the scheduler's ``fire`` (a lifecycle edge, recorded).
        probe: the speculative n-gram probe (#33), or None.
        step: the step being built.
        budget: tokens and rows left in this step.

    Afterwards ``num_prefill_tokens`` holds the prefill tokens its rows schedule.
    """

    def __init__(self, config: SchedulerConfig, arrays: RequestArrays, kv: KVManager,
                 views: SlotViews, queues: RequestQueues, fire: Callable[[Request, str], None],
                 probe: NgramProbe | None, step: int, budget: StepBudget) -> None:
        self.config, self.views, self.queues, self.fire = config, views, queues, fire
        self.probe, self.step, self.budget = probe, step, budget
        self.arrays = arrays
        self.cadence = config.cadence
        self.num_prefill_tokens = 0
        self.req_ids: list[str] = []         # [num_rows] (all rows so far)
        self._rows: list[tuple[int, ...]] = []   # rows added one by one since the last part:
        # (slot, tokens, start, final, epoch, drafts) each
        self._parts: list[tuple[np.ndarray, ...]] = []   # 6 columns, [n] int64 each
        self.new: list[NewRequest] = []
        self.kv = kv
        self.preempted = False

    def _row(self, req: Request, num_scheduled_tokens: int, final: bool, counts_row: bool = True,
             outputs: int = 1) -> None:
        a, slot = self.arrays, req.slot
        self.req_ids.append(req.req_id)
        self._rows.append((slot, num_scheduled_tokens, int(a.num_computed_tokens[slot]), final,
                           req.epoch, outputs - 1 if req.state == "decoding" else 0))
        if req.state == "prefilling":
            self.num_prefill_tokens += num_scheduled_tokens
        a.num_computed_tokens[slot] += num_scheduled_tokens
        self.kv.grow(req, int(a.num_computed_tokens[slot]))
        self.kv.register_full(req, int(a.num_computed_tokens[slot]))
        if final:
            a.num_sampling_rows[slot] += outputs  # 1 + drafts: optimistic, see on_step_result
            a.next_eligible_step[slot] = self.step + self.cadence
        else:
            a.next_eligible_step[slot] = self.step + 1
        self.budget.take(num_scheduled_tokens, counts_row)

    def _flush(self) -> None:
        """Move the rows added one by one into a part (keeps row order)."""
        if self._rows:
            self._parts.append(tuple(np.array(c, dtype=np.int64) for c in zip(*self._rows)))
            self._rows = []

    def _decode_candidates(self) -> np.ndarray:
        """``[num_eligible]`` slots of decoding requests that may get a decode row now (eligible
        and below max_tokens, optimistic outputs), oldest eligibility first, then admission
        order (= epoch order, the order of the running requests)."""
        a, s = self.arrays, self.views
        ok = a.next_eligible_step <= np.array(self.step, dtype=np.int64)  # [max_num_reqs]
        ok &= s.decoding
        ok &= a.num_sampling_rows < a.max_tokens
        cand = ok.nonzero()[0]
        return cand[np.lexsort((s.slot_epoch[cand], a.next_eligible_step[cand]))]

    def add_decodes(self) -> None:
        """Rows for decoding requests that are eligible and below max_tokens (optimistic outputs):
        one token each, or with speculative decoding ``1 + k`` (the last sampled token and ``k``
        drafts, :meth:`_decode_tokens`).

        Without speculation the rows are added with array operations (:meth:`_bulk_decodes`):
        all at once when the free KV blocks suffice for every row whose token starts a new block
        (at most one per ``block_size`` steps of a request), so that none can preempt. Otherwise
        runs of rows whose token fits a block the request holds are added in bulk, and each row
        that needs a block goes through :meth:`_room` (which may preempt) and :meth:`_row` in
        its place in the order, exactly as a row-by-row loop would. With speculation the same
        holds for a step in which the probe finds no proposal for any candidate (every row one
        token, :meth:`_any_proposal`); otherwise rows are added one by one (:meth:`_spec_decodes`)."""
        cfg = self.config
        order = self._decode_candidates()                                  # [num_eligible]
        if not order.size:
            return
        if cfg.num_spec_tokens and self._any_proposal(order):
            self._spec_decodes(order)
            return
        a, kv, budget = self.arrays, self.kv, self.budget
        n = min(order.size, budget.tokens, budget.rows)
        if n <= 0:
            return
        head = order[:n] if n < order.size else order                      # [n]
        starts = a.num_computed_tokens[head]                               # [n]
        new_block = starts >= kv.held[head] * kv.block_size_np             # [n]
        num_new = np.count_nonzero(new_block)
        if num_new <= kv.pool.num_free:  # every row gets its block: no preemption
            self._bulk_decodes(head, starts, new_block.nonzero()[0] if num_new else None)
            return
        slow = new_block.nonzero()[0].tolist() if n == order.size else \
            (a.num_computed_tokens[order] >= kv.held[order] * kv.block_size).nonzero()[0].tolist()
        pos = 0
        for j in slow + [order.size]:  # short of blocks: rows that need one may preempt
            if pos < j:
                self._bulk_run(order[pos:j])
            if j == order.size or not budget.can_add():
                return
            req = self.views.slot_req[int(order[j])]
            if req is not None and self._room(req, 1) == 1:  # None: preempted in this loop
                self._row(req, 1, True)
            pos = j + 1

    def _bulk_run(self, slots: np.ndarray) -> None:
        """One-token decode rows for ``slots`` (``[n]``, in order) whose tokens lie in blocks
        their requests hold: those still running (not preempted in this step), as many as the
        budget allows."""
        slots = slots[self.views.slot_epoch[slots] != 0]
        n = min(slots.size, self.budget.tokens, self.budget.rows)
        if n > 0:
            slots = slots[:n]
            self._bulk_decodes(slots, self.arrays.num_computed_tokens[slots], None)

    def _bulk_decodes(self, slots: np.ndarray, starts: np.ndarray,
                      new_rows: np.ndarray | None) -> None:
        """One-token decode rows for ``slots`` (``[n]``, in order; running, within the budget),
        with the arrays updated at once. ``starts``: ``[n]`` their ``num_computed_tokens``;
        ``new_rows``: ``[k]`` indices of the rows whose token needs a new KV block (the free
        blocks suffice, :meth:`KVManager.grow_by_one_block`), None when none does."""
        a = self.arrays
        n = slots.size
        self._flush()
        ones = _ONES[:n] if n <= _ONES.size else np.ones(n, dtype=np.int64)  # read-only
        self._parts.append((slots, ones, starts, ones, self.views.slot_epoch[slots],
                            np.zeros(n, dtype=np.int64)))
        ids = gather(self.queues.slots.owner, slots.tolist())  # [n] request ids
        self.req_ids += ids
        a.num_computed_tokens[slots] = starts + ONE_I64
        if new_rows is not None:
            self.kv.grow_by_one_block(slots[new_rows], gather(ids, new_rows.tolist()))
        a.num_sampling_rows[slots] += ONE_I64
        a.next_eligible_step[slots] = self.step + self.cadence
        self.budget.tokens -= n
        self.budget.rows -= n

    def _any_proposal(self, order: np.ndarray) -> bool:
        """Whether any of the candidates ``order`` (``[n]`` slots) may get drafts in this step.
        False only when the scheduler's probe finds no proposal for any of them (issue #33):
        every row then gets one token, exactly as without speculation, so the rows are added
        by the bulk path of a spec-off step (:meth:`_bulk_decodes`) instead of one by one.
        Without a probe, True (rows get drafts wherever room and budget allow)."""
        probe = self.probe
        if probe is None:
            return True
        a, reqs, out = self.arrays, self.views.slot_req, self.views.out_tokens
        for slot in order.tolist():
            req = reqs[slot]
            if probe.has_proposal(req, req.spec.prompt_token_ids,
                                  out[slot, :a.num_output_tokens[slot]]):
                return True
        return False

    def _spec_decodes(self, order: np.ndarray) -> None:
        """Decode rows with speculative drafts (#14), one by one in ``order`` (``[n]`` slots)."""
        for slot in order.tolist():
            if not self.budget.can_add():
                break
            req = self.views.slot_req[slot]
            if req is None:  # preempted earlier in this loop
                continue
            if (got := self._room(req, self._decode_tokens(req))) >= 1:
                self._row(req, got, True, outputs=got)

    def _decode_tokens(self, req: Request) -> int:
        """Tokens of ``req``'s decode row: 1, plus ``k`` speculative drafts when
        ``num_spec_tokens`` > 0. ``k`` is capped by the outputs the request may still produce
        (optimistic count, so an accepted run never passes max_tokens / max_seq_len: no early
        finish, no position past the slot's KV) and by the step's token budget."""
        k_max = self.config.num_spec_tokens
        if k_max == 0:
            return 1
        a = self.arrays
        probe = self.probe   # issue #33: no drafts where the proposer finds none
        if probe is not None and not probe.has_proposal(
                req, req.spec.prompt_token_ids,
                self.views.out_tokens[req.slot, :a.num_output_tokens[req.slot]]):
            return 1
        room = int(a.max_tokens[req.slot] - a.num_sampling_rows[req.slot]) - 1
        return 1 + drafts_for_row(room, k_max, self.budget.tokens)

    def _room(self, req: Request, want: int) -> int:
        """Tokens (<= want, >= 1 unless 0) of ``req``'s next row the KV blocks can hold, preempting
        the youngest running request without a row in this step while none fit (0: ``req``
        itself was preempted or no victim is left)."""
        computed = int(self.arrays.num_computed_tokens[req.slot])
        while (fit := self.kv.tokens_fit(req, computed, want)) < 1:
            victim = self.queues.youngest_running(set(self.req_ids))
            if victim is None:
                return 0
            self.queues.preempt(victim)
            self.preempted = True
            if victim is req:
                return 0
        return fit

    def _add_chunk(self, req: Request, counts_row: bool, fit: int | None = None) -> None:
        a, slot = self.arrays, req.slot
        remaining = int(a.prefill_len[slot] - a.num_computed_tokens[slot])
        limit = chunk_limit(self.config, int(a.num_computed_tokens[slot]))  # issue 11
        chunk = min(remaining, limit, self.budget.tokens)
        chunk = self._room(req, chunk) if fit is None else min(chunk, fit)
        if chunk < 1:
            return
        final = chunk == remaining
        self._row(req, chunk, final, counts_row)
        if final:
            self.fire(req, "complete_prefill")
            self.views.decoding[slot] = True

    def add_continuing_prefills(self) -> None:
        """Next chunk of every admitted request still prefilling (consecutive steps).

        These rows use tokens but not the balanced row share: a long prompt occupies consecutive
        steps for a while and must not block admissions (its lane is only chosen by its final
        chunk).
        """
        s = self.views
        if np.count_nonzero(s.decoding) == len(self.queues.running):
            return  # every running request is decoding
        cand = ((s.slot_epoch != 0) & ~s.decoding &
                (self.arrays.next_eligible_step <= self.step)).nonzero()[0]  # [num_prefilling]
        if not cand.size:
            return
        for slot in cand[np.argsort(s.slot_epoch[cand])].tolist():  # admission order
            req = s.slot_req[slot]
            if req is None:  # preempted earlier in this loop
                continue
            if self.budget.tokens <= 0:
                return
            self._add_chunk(req, counts_row=False)

    def admit_waiting(self) -> None:
        """FCFS admission into free slots while the first chunk fits the free KV blocks (minus the
        watermark); a prefix-cache hit starts the chunk at the first uncached token. Nothing is
        admitted in a step that preempted."""
        q = self.queues
        while not self.preempted and self.budget.can_add() and q.slots.num_free > 0:
            req = q.peek_waiting()
            if req is None or q.fork_waits(req):
                return  # FCFS: a fork waits at the head until its parent's prefill is scheduled
            hit = self.kv.prefix_hit(req)
            remaining = len(req.prefill_tokens) - len(hit) * self.kv.block_size
            limit = chunk_limit(self.config, len(hit) * self.kv.block_size)  # issue 11
            chunk = min(remaining, limit, self.budget.tokens)
            fit = self.kv.admissible_tokens(hit, chunk)
            if fit < 1:
                return  # FCFS: the head waits for blocks
            q.pop_waiting()
            self.new.append(q.place(req, self.step, hit))
            self._add_chunk(req, counts_row=True, fit=fit)

    def build(self, freed: tuple[FreedSlot, ...],
              deltas: tuple[np.ndarray, np.ndarray, np.ndarray],
              digests: BlockDigests | None = None) -> SchedulerOutput:
        """The step's SchedulerOutput (arrays ``[num_rows]``; block-table deltas ``[U]``; the
        rows' block digests from ``digests``, after this step's deltas were applied to it).
        Afterwards ``row_epochs`` and ``row_drafts`` (``[num_rows]`` int64) hold each row's
        admission epoch and drafts (the scheduler keeps them while the step is in flight)."""
        self._flush()
        parts = self._parts
        if len(parts) == 1:
            cols = parts[0]
        elif parts:
            cols = [np.concatenate(c) for c in zip(*parts)]
        else:
            cols = [np.zeros(0, dtype=np.int64)] * 6
        slots, ntok, starts, final, self.row_epochs, self.row_drafts = cols
        return SchedulerOutput(
            step=self.step, req_ids=tuple(self.req_ids),
            slots=slots.astype(np.int32),                               # [num_rows]
            num_scheduled_tokens=ntok.astype(np.int32),                 # [num_rows]
            start_positions=starts.astype(np.int32),                    # [num_rows]
            is_final_chunk=final.astype(bool),                          # [num_rows]
            new_requests=tuple(self.new), freed=freed, block_table_slots=deltas[0],
            block_table_cols=deltas[1], block_table_ids=deltas[2],
            block_digests=None if digests is None else digests.of(slots))
