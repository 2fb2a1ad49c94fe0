"""How a step's result reaches the requests: :class:`StepResults`, an object the scheduler owns.

Results arrive in step order. Each live sampling row's tokens are appended to its request, which
stops at the first EOS (unless ignore_eos) or stop token id, or at ``max_tokens``; a finished
request frees its slot and KV blocks (:meth:`RequestQueues.finish
<ppstate.scheduler_queues.RequestQueues.finish>`). The handler also keeps the steps in flight
(each row's admission epoch and drafts) and the speculative-decoding counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections import deque
from operator import itemgetter

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.budget import RequestArrays, SchedulerConfig
from ppstate.errors import SchedulerError
from ppstate.request import Request, RequestSpec, TokenUpdate
from ppstate.scalars import ONE_I32, ONE_I64, ZERO_I32
from ppstate.scheduler_queues import RequestQueues
from ppstate.slot_views import SlotViews
from ppstate.step_updates import StepUpdates


def gather(seq: Sequence, idx: list[int]) -> Sequence:
    """``[seq[i] for i in idx]`` at C speed (a tuple; ``itemgetter`` of one index would return
    the item itself)."""
    return itemgetter(*idx)(seq) if len(idx) > 1 else tuple(seq[i] for i in idx)


def may_stop(tokens: np.ndarray, stop_ids: np.ndarray) -> np.ndarray:
    """``[n]`` bool: ``tokens`` (``[n]``) that are in ``stop_ids`` (``[m]``, every EOS / stop id
    of any request; a superset is fine, the rows found are checked per request)."""
    if stop_ids.size == 0:
        return np.zeros(tokens.shape, dtype=bool)
    if stop_ids.size <= 16:
        return (tokens[:, None] == stop_ids[None, :]).any(axis=1)
    return np.isin(tokens, stop_ids)  # finished requests whose final state state_of still answers


class StepResults:
    """The result side of the scheduler: the steps in flight and :meth:`apply`.

    Args:
        config: budgets (``num_spec_tokens``).
        arrays: per-slot progress (``[max_num_seqs]`` each), updated per token.
        views: the slot-indexed views (epochs decide which rows are live; ``out_tokens`` gets
            the tokens).
        queues: the request queues (a request that stops is finished there).

    Attributes:
        in_flight: issued steps whose result has not arrived, oldest first.
        in_flight_epochs: per in-flight step, ``[num_rows]`` int64 admission epoch of each row.
        in_flight_drafts: per in-flight step, ``[num_rows]`` int64 drafts of each row.
        stop_ids_np: ``[num_stop_ids]`` int64, sorted: every EOS / stop id of any request added.
        num_discarded_rows: results of rows whose request had left the slot (dropped).
        num_spec_rows, num_spec_proposed, num_spec_rejected: decode rows that carried drafts,
            drafts proposed and drafts rejected (tokens), cumulative.
    """

    def __init__(self, config: SchedulerConfig, arrays: RequestArrays, views: SlotViews,
                 queues: RequestQueues) -> None:
        self.config, self.arrays, self.views, self.queues = config, arrays, views, queues
        self.in_flight: deque[SchedulerOutput] = deque()
        self.in_flight_epochs: deque[np.ndarray] = deque()
        self.in_flight_drafts: deque[np.ndarray] = deque()
        self._stop_ids: set[int] = set()
        self.stop_ids_np = np.zeros(0, dtype=np.int64)
        self.num_discarded_rows = 0
        self.num_spec_rejected = 0
        self.num_spec_proposed = 0
        self.num_spec_rows = 0

    def add_stop_ids(self, spec: RequestSpec) -> None:
        """Include the EOS and stop token ids of ``spec`` in :attr:`stop_ids_np`."""
        if not self._stop_ids.issuperset(spec.eos_token_ids | spec.stop_token_ids):
            self._stop_ids |= spec.eos_token_ids | spec.stop_token_ids
            self.stop_ids_np = np.array(sorted(self._stop_ids), dtype=np.int64)

    def issue(self, out: SchedulerOutput, epochs: np.ndarray, drafts: np.ndarray) -> None:
        """Step ``out`` was issued: its rows' epochs and drafts (``[num_rows]`` int64 each)."""
        self.in_flight.append(out)
        self.in_flight_epochs.append(epochs)
        self.in_flight_drafts.append(drafts)

    def apply(self, result: StepResult) -> tuple[Sequence[TokenUpdate], int]:
        """Apply the last rank's output of the oldest in-flight step
        (:meth:`Scheduler.on_step_result <ppstate.scheduler.Scheduler.on_step_result>`).

        Returns:
            The token updates and the number of discarded rows (rows the last rank sampled into
            a slot whose request left it since).

        Raises:
            SchedulerError: ``result.step`` is not the oldest in-flight step, or its row count
                differs from that step's.
        """
        if not self.in_flight or self.in_flight[0].step != result.step:
            expected = self.in_flight[0].step if self.in_flight else None
            raise SchedulerError(f"step result {result.step} out of order (expected {expected})")
        out = self.in_flight[0]
        if len(result.num_sampled) != out.num_rows:
            raise SchedulerError(f"step {result.step}: result has {len(result.num_sampled)} rows, "
                                 f"the step had {out.num_rows}")
        self.in_flight.popleft()
        epochs = self.in_flight_epochs.popleft()     # [num_rows]
        drafts = self.in_flight_drafts.popleft()     # [num_rows]
        # rows the last rank sampled into a slot whose request left it since (finished,
        # aborted, preempted): applied to the old slot there, dropped here
        discarded = int(np.count_nonzero(out.is_final_chunk &
                                         (self.views.slot_epoch[out.slots] != np.asarray(epochs))))
        self.num_discarded_rows += discarded
        one_token = not self.config.num_spec_tokens or not np.count_nonzero(drafts)  # no drafts
        updates = self._apply_one_token_rows(out, result, epochs) if one_token else None
        if updates is None:
            updates = self._apply_rows(out, result, epochs, drafts)
        return updates, discarded

    def _live_rows(self, out: SchedulerOutput, result: StepResult,
                   epochs: np.ndarray) -> np.ndarray:
        """``[num_live]`` indices of the rows whose request is still running in the admission
        that scheduled them (slot epoch unchanged), that are final and sampled something."""
        return ((result.num_sampled > 0) & out.is_final_chunk &
                (self.views.slot_epoch[out.slots] == np.asarray(epochs))).nonzero()[0]

    def _apply_one_token_rows(self, out: SchedulerOutput, result: StepResult,
                              epochs: np.ndarray) -> StepUpdates | None:
        """:meth:`on_step_result` for a step without drafts whose live rows sampled one token
        each (None otherwise): counters and output lists updated at once; Python per row only
        for rows whose token may end the request (a known EOS / stop id, or max_tokens)."""
        slots = out.slots.astype(np.int64)     # [num_rows] (int64 indexes faster than int32)
        ns = result.num_sampled                                         # [num_rows]
        live = self.views.slot_epoch[slots] == np.asarray(epochs)             # [num_rows]
        live &= out.is_final_chunk
        not_one = ns != ONE_I32                                         # [num_rows]
        if np.count_nonzero(not_one):  # rows that sampled nothing or several tokens
            live &= ns > ZERO_I32
            if np.count_nonzero(not_one & live):
                return None
        rows = None if np.count_nonzero(live) == live.size else live.nonzero()[0]  # None: all
        if rows is None:  # every row (the usual decode step)
            toks = result.sampled_token_ids[:, 0]                      # [n]
        else:
            slots, toks = slots[rows], result.sampled_token_ids[rows, 0]
        a = self.arrays
        received = a.num_output_tokens[slots]                          # [n]
        self.views.out_tokens[slots, received] = toks
        count = received + ONE_I64
        a.num_output_tokens[slots] = count
        end = count >= a.max_tokens[slots]                             # [n]
        if self.stop_ids_np.size:
            end |= may_stop(toks, self.stop_ids_np)
        ends = end.nonzero()[0]
        tok_list = toks.tolist()
        reasons: dict[int, str] = {}
        for i in ends.tolist():
            req, tok = self.views.slot_req[int(slots[i])], tok_list[i]
            reason = req.spec.stop_reason(tok)
            if reason is None and count[i] >= req.max_tokens:
                reason = "length"
            if reason is not None:
                reasons[i] = reason
                self.queues.finish(req, "stop" if reason == "stop" else "hit_length")
        ids = out.req_ids if rows is None else gather(out.req_ids, rows.tolist())
        return StepUpdates(ids, tok_list, reasons)

    def _apply_rows(self, out: SchedulerOutput, result: StepResult, epochs: np.ndarray,
                    drafts: np.ndarray) -> list[TokenUpdate]:
        """:meth:`on_step_result` row by row (speculative decoding: several tokens per row)."""
        updates = []
        num_sampled, drafts = result.num_sampled.tolist(), np.asarray(drafts).tolist()
        sampled = result.sampled_token_ids.tolist()     # [num_rows][width] python ints
        for i in self._live_rows(out, result, epochs).tolist():
            req = self.views.slot_req[int(out.slots[i])]
            if drafts[i] > 0:  # speculative decoding (#14)
                self._spec_row(req, drafts[i], int(result.num_rejected[i]))
            updates.append(self._append_tokens(req, sampled[i][:num_sampled[i]]))
        return updates

    def spec_stats(self) -> dict[str, int]:
        """Speculative decoding counters (tokens / rows, cumulative): drafts proposed and
        accepted, decode rows that carried drafts. Acceptance rate = accepted / proposed; tokens
        per such row = 1 + accepted / rows."""
        return {"spec_proposed_tokens": self.num_spec_proposed,
                "spec_accepted_tokens": self.num_spec_proposed - self.num_spec_rejected,
                "spec_decode_rows": self.num_spec_rows}

    def _spec_row(self, req: Request, drafts: int, rejected: int) -> None:
        """Count a decode row that carried ``drafts`` drafts, and apply its correction."""
        self.num_spec_rows += 1
        self.num_spec_proposed += drafts
        if rejected > 0:
            self._correct_rejected(req, rejected)

    def _correct_rejected(self, req: Request, rejected: int) -> None:
        """The deferred correction of a decode row whose last ``rejected`` drafts were rejected:
        the scheduler scheduled (and took KV blocks for) the row's ``1 + k`` tokens optimistically;
        the rejected positions are recomputed by a later row. Rows of ``req`` scheduled before this
        result arrived carry a start position ``rejected`` too high; the ranks position every row
        from their own corrected counters (they consume the same correction first), and the
        blocks already taken stay with the request (``CpuMirror.validate_blocks`` allows them)."""
        self.arrays.num_computed_tokens[req.slot] -= rejected
        self.arrays.num_sampling_rows[req.slot] -= rejected
        self.num_spec_rejected += rejected

    def _append_tokens(self, req: Request, tokens: list[int]) -> TokenUpdate:
        slot, taken, reason = req.slot, [], None
        count = int(self.arrays.num_output_tokens[slot])
        row = self.views.out_tokens[slot]                       # [max_model_len]
        for tok in tokens:
            tok = int(tok)
            taken.append(tok)
            row[count] = tok
            count += 1
            reason = req.spec.stop_reason(tok)
            if reason is None and count >= req.max_tokens:
                reason = "length"
            if reason is not None:
                break
        self.arrays.num_output_tokens[slot] = count
        if reason is not None:
            self.queues.finish(req, "stop" if reason == "stop" else "hit_length")
        return TokenUpdate(req.req_id, taken, reason)
