"""How a step's result reaches the requests: :class:`StepResults`, a part of
:class:`ppstate.scheduler.Scheduler` (a mixin; it holds no state of its own).

Results arrive in step order. Each live sampling row's tokens are appended to its request, which
stops at the first EOS (unless ignore_eos) or stop token id, or at ``max_tokens``; a finished
request frees its slot and KV blocks and is remembered (final state only) among the
``FINISHED_HISTORY`` most recent ones.
"""

from __future__ import annotations

from collections.abc import Callable
from collections import OrderedDict, deque

from ppstate.batch import FreedSlot, SchedulerOutput, StepResult
from ppstate.budget import RequestArrays
from ppstate.errors import SchedulerError
from ppstate.events import EventSink
from ppstate.kv_manager import KVManager
from ppstate.lifecycle import Lifecycle
from ppstate.request import Request, TokenUpdate
from ppstate.slots import SlotTable

FINISHED_HISTORY = 1024  # finished requests whose final state state_of still answers


class StepResults:
    """The result side of the scheduler: :meth:`on_step_result` and the finishing of a request.

    Uses the scheduler's state (annotated below; set by ``Scheduler.__init__``) and its
    :meth:`fire`.
    """
    sink: EventSink
    arrays: RequestArrays                        # per-slot progress, [max_num_seqs] each
    slots: SlotTable
    lifecycle: Lifecycle
    kv: KVManager
    _next_step: int
    _running: dict[str, Request]
    _live: dict[str, Request]
    _finished: OrderedDict[str, str]
    _freed: list[FreedSlot]
    _in_flight: deque[SchedulerOutput]
    _in_flight_epochs: deque[list[int]]
    _in_flight_drafts: deque[list[int]]          # per in-flight step: drafts of each row
    num_spec_rows: int                           # decode rows that carried drafts (cumulative)
    num_spec_proposed: int                       # drafts proposed (tokens, cumulative)
    num_spec_rejected: int                       # drafts rejected (tokens, cumulative)
    fire: Callable[[Request, str], None]         # Scheduler.fire: a lifecycle edge, recorded

    def on_step_result(self, result: StepResult) -> list[TokenUpdate]:
        """Apply the last rank's output of the oldest in-flight step.

        Rows of requests no longer live (finished at an earlier step, aborted), rows scheduled
        before a preemption of their request, and rows that are non-final prefill chunks are
        ignored. A request stops at the first EOS (unless ignore_eos)
        or stop token id, or when it has max_tokens tokens; its slot is freed then.

        Returns:
            One TokenUpdate per live sampling row with ``num_sampled > 0``, in row order.

        Raises:
            SchedulerError: ``result.step`` is not the oldest in-flight step, or its row count
                differs from that step's.
        """
        if self.sink.enabled:
            self.sink.emit("result", step=self._next_step, of_step=result.step,
                           token_ids=result.sampled_token_ids.tolist(),
                           num_sampled=result.num_sampled.tolist(),
                           num_rejected=result.num_rejected.tolist())
        if not self._in_flight or self._in_flight[0].step != result.step:
            expected = self._in_flight[0].step if self._in_flight else None
            raise SchedulerError(f"step result {result.step} out of order (expected {expected})")
        out = self._in_flight[0]
        if len(result.num_sampled) != out.num_rows:
            raise SchedulerError(f"step {result.step}: result has {len(result.num_sampled)} rows, "
                                 f"the step had {out.num_rows}")
        self._in_flight.popleft()
        epochs = self._in_flight_epochs.popleft()
        drafts = self._in_flight_drafts.popleft()
        updates = []
        num_sampled, final = result.num_sampled.tolist(), out.is_final_chunk.tolist()
        sampled = result.sampled_token_ids.tolist()     # [num_rows][width] python ints
        for i, req_id in enumerate(out.req_ids):
            req = self._running.get(req_id)
            n = num_sampled[i]
            if req is None or n <= 0 or not final[i] or req.epoch != epochs[i]:
                continue  # gone, not sampling, or a row of an admission ended by preemption
            if drafts[i] > 0:  # speculative decoding (#14)
                self._spec_row(req, drafts[i], int(result.num_rejected[i]))
            updates.append(self._append_tokens(req, sampled[i][:n]))
        if self.sink.enabled:
            self.sink.emit("tokens", step=self._next_step, of_step=result.step,
                           updates=[vars(u) for u in updates])
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
        for tok in tokens:
            tok = int(tok)
            taken.append(tok)
            req.output_token_ids.append(tok)
            count += 1
            reason = req.spec.stop_reason(tok)
            if reason is None and count >= req.max_tokens:
                reason = "length"
            if reason is not None:
                break
        self.arrays.num_output_tokens[slot] = count
        if reason is not None:
            self._finish(req, "stop" if reason == "stop" else "hit_length")
        return TokenUpdate(req.req_id, taken, reason)

    def _finish(self, req: Request, trigger: str) -> None:
        self.fire(req, trigger)
        if req.slot >= 0:
            self.kv.free(req)
            self.slots.free(req.req_id)
            self._freed.append(FreedSlot(req.req_id, req.slot, req.state))
            del self._running[req.req_id]
        self._finished[req.req_id] = req.state
        self._finished.move_to_end(req.req_id)
        while len(self._finished) > FINISHED_HISTORY:
            self._finished.popitem(last=False)
        del self._live[req.req_id]
        self.lifecycle.remove(req)
