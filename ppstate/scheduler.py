"""Continuous-batching scheduler for a pipeline of ``pp_size`` stages.

Per step (:meth:`Scheduler.schedule`): eligible decode rows first (a request that sampled at step t
is eligible again at t + cadence, optimistically, before t's result has arrived), then continuing
prefill chunks (one request's chunks go in consecutive steps), then FCFS admission of waiting
requests into free slots, all within ``max_num_batched_tokens``, ``max_prefill_chunk`` and the
balanced-admission row cap. Its only output is a :class:`~ppstate.batch.SchedulerOutput`.
Results come back in step order through :meth:`Scheduler.on_step_result`.

Lifecycle edges go through :class:`~ppstate.lifecycle.Lifecycle`; per-token counters live in
:class:`~ppstate.budget.RequestArrays`; KV blocks in :class:`~ppstate.kv_manager.KVManager` (taken
when a row is scheduled; when a running request cannot get one, the youngest running request is
preempted and later recomputed). Sources: vLLM V1 ``core/sched/scheduler.py`` +
``async_scheduler.py`` (PP throttle) and Model Runner V2 "Avoid pipeline parallel bubbles".
"""

from __future__ import annotations

from collections import OrderedDict, deque


from ppstate.blocks import block_hashes
from ppstate.batch import FreedSlot, NewRequest, SchedulerOutput, StepResult
from ppstate.budget import RequestArrays, SchedulerConfig, StepBudget
from ppstate.errors import SchedulerError
from ppstate.events import NULL_SINK, EventSink
from ppstate.kv_manager import KVManager
from ppstate.lanes import choose_lanes
from ppstate.lifecycle import Lifecycle
from ppstate.request import FINISH_REASONS, Request, RequestSpec, TokenUpdate
from ppstate.scheduler_rows import RowBuilder
from ppstate.slots import SlotTable
from ppstate.trace.codec import encode_output

__all__ = ["Scheduler", "SchedulerConfig", "RequestSpec", "TokenUpdate", "FINISHED_HISTORY"]

FINISHED_HISTORY = 1024  # finished requests whose final state state_of still answers


class Scheduler:
    """Continuous batching over ``config.max_num_seqs`` slots.

    Args:
        config: budgets, pp_size and mode.
        sink: event sink: inputs (``arrival``, ``abort``, ``stop``, ``result``) and decisions
            (``lifecycle``, ``schedule``, ``tokens``); enough to replay the scheduler
            (``docs/trace_format.md``).
    """

    def __init__(self, config: SchedulerConfig, sink: EventSink = NULL_SINK) -> None:
        self.config, self.sink = config, sink
        self.slots = SlotTable(config.max_num_seqs)
        self.arrays = RequestArrays(config.max_num_seqs)
        self.lifecycle = Lifecycle()
        self.kv = KVManager(config)
        self.num_preemptions = 0
        self.num_prefill_tokens = 0   # prefill tokens scheduled (computed), prefix hits excluded
        self.num_spec_rejected = 0    # speculative drafts rejected so far (tokens)
        self.num_spec_proposed = 0    # speculative drafts in rows whose result arrived (tokens)
        self.num_spec_rows = 0        # decode rows with drafts whose result arrived
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}          # admission order
        self._live: dict[str, Request] = {}             # waiting + running, by id
        # req_id -> final state of the FINISHED_HISTORY most recent finished requests (for
        # state_of only; a long-running server must not keep every id it ever served)
        self._finished: OrderedDict[str, str] = OrderedDict()
        self._freed: list[FreedSlot] = []               # delivered with the next output
        self._in_flight: deque[SchedulerOutput] = deque()
        self._in_flight_epochs: deque[list[int]] = deque()  # per row: the request's epoch
        self._in_flight_drafts: deque[list[int]] = deque()  # per row: speculative drafts
        self._next_step = 0
        self._order = 0
        self._admissions = 0   # admissions so far (all requests): each admission's unique epoch
        self.lanes = config.pp_size  # lanes filled with decode rows this step (ppstate.lanes)

    # ---------------------------------------------------------------- queries
    @property
    def in_flight(self) -> int:
        """Steps issued whose StepResult has not arrived."""
        return len(self._in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def next_step(self) -> int:
        """Number the next issued step will get."""
        return self._next_step

    def has_unfinished(self) -> bool:
        """True while some request is waiting or holds a slot."""
        return bool(self._waiting or self._running)

    def is_live(self, req_id: str) -> bool:
        """True while ``req_id`` is waiting or holds a slot (its id cannot be added again)."""
        return req_id in self._live

    def state_of(self, req_id: str) -> str:
        """Lifecycle state of ``req_id``: a live request's, or the final state of one of the
        ``FINISHED_HISTORY`` most recently finished requests.

        Raises:
            SchedulerError: unknown id (never seen, or finished longer ago than that).
        """
        req = self._live.get(req_id)
        if req is not None:
            return req.state
        if req_id in self._finished:
            return self._finished[req_id]
        raise SchedulerError(f"unknown request {req_id!r}")

    # ---------------------------------------------------------------- client side
    def add_request(self, spec: RequestSpec) -> None:
        """Queue ``spec`` (FCFS). The id of a finished (or aborted) request may be used again, as
        in vLLM: only ids of live requests are rejected. Rows of the earlier request still in
        flight are told apart by their admission epoch (unique per admission).

        Raises:
            SchedulerError: id of a live (waiting or running) request, empty prompt, prompt_len >= max_model_len, max_tokens < 1,
                or prompt + max_tokens needing more KV blocks than the cache has (names both).
        """
        rid, plen = spec.req_id, spec.prompt_len
        if rid in self._live:
            raise SchedulerError(f"duplicate request id {rid!r}: a request with this id is live")
        if plen == 0:
            raise SchedulerError(f"request {rid!r}: empty prompt")
        if self.config.output_room(plen) < 1:
            raise SchedulerError(f"request {rid!r}: prompt of {plen} tokens does not fit "
                                 f"max_model_len={self.config.max_model_len}")
        if spec.max_tokens < 1:
            raise SchedulerError(f"request {rid!r}: max_tokens must be >= 1, got {spec.max_tokens}")
        if self.sink.enabled:
            self.sink.emit("arrival", step=self._next_step, **arrival_fields(spec, self.sink, self.config))
        max_tokens = min(spec.max_tokens, self.config.output_room(plen))
        cap = self.config.kv_capacity_tokens
        if plen + max_tokens - 1 > cap:  # the last sampled token is never fed back
            raise SchedulerError(f"request {rid!r}: prompt of {plen} tokens + max_tokens "
                                 f"{max_tokens} needs KV cache for {plen + max_tokens - 1} tokens; "
                                 f"the cache holds {cap}")
        req = Request(spec, max_tokens, self.arrays, self._order)
        self._order += 1
        self.lifecycle.add(req)
        self._waiting.append(req)
        self._live[rid] = req

    def abort(self, req_id: str) -> bool:
        """Abort ``req_id`` now; its slot is freed (FreedSlot in the next output).

        Returns:
            False when the id is unknown or the request already finished.
        """
        if self.sink.enabled:
            self.sink.emit("abort", step=self._next_step, req_id=req_id)
        req = self._live.get(req_id)
        if req is None:
            return False
        if req.slot < 0:
            self._waiting.remove(req)
        self._finish(req, "abort")
        return True

    def stop(self, req_id: str) -> bool:
        """External stop (e.g. a stop string found by the engine): decoding -> finished_stopped.

        Returns:
            False unless ``req_id`` is decoding.
        """
        if self.sink.enabled:
            self.sink.emit("stop", step=self._next_step, req_id=req_id)
        req = self._running.get(req_id)
        if req is None or req.state != "decoding":
            return False
        self._finish(req, "stop")
        return True

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput | None:
        """Issue the next step.

        Returns:
            None when ``in_flight_limit`` steps are in flight, or nothing needs delivering and no
            live request can get a row before more results arrive. Otherwise the step's output,
            possibly without rows (nothing eligible this step under the cadence, or only
            ``freed`` to deliver), so that step numbers and every rank's FIFO keep advancing.
        """
        if self.in_flight >= self.config.in_flight_limit:
            return None
        if not (self._waiting or self._freed) and self._all_awaiting_results():
            return None
        step = self._next_step
        self.lanes = choose_lanes(self.config, self._live_share())  # issue 11: adaptive lanes
        rows = RowBuilder(self, step, StepBudget(self.config.step_token_budget,
                                                 self.row_cap()))
        rows.add_decodes()
        rows.add_continuing_prefills()
        rows.admit_waiting()
        out = rows.build(tuple(self._freed), self.kv.take_deltas())
        self._freed = []
        self._next_step += 1
        self._in_flight.append(out)
        self._in_flight_epochs.append(rows.epochs)
        self._in_flight_drafts.append(rows.drafts)
        if self.sink.enabled:
            self.sink.emit("schedule", step=step,
                           output=encode_output(out, self.sink.trace_prompts))
        return out

    def _all_awaiting_results(self) -> bool:
        """True when no live request can get a row before more results arrive (or none is live):
        every one has all its max_tokens sampling rows in flight."""
        a = self.arrays
        return all(r.state == "decoding" and a.num_sampling_rows[r.slot] >= a.max_tokens[r.slot]
                   for r in self._running.values())

    def kv_stats(self) -> dict[str, float | int]:
        """KV-cache counters: blocks (total / free incl. cached / cached), prefix-cache lookups
        and hits (tokens), hit rate, preemptions and prefill tokens computed so far."""
        pool = self.kv.pool
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free,
                "kv_blocks_cached": pool.num_cached, "prefix_cache_query_tokens": pool.query_tokens,
                "prefix_cache_hit_tokens": pool.hit_tokens, "prefix_cache_hit_rate": pool.hit_rate,
                "num_preemptions": self.num_preemptions,
                "prefill_tokens_computed": self.num_prefill_tokens}

    def row_cap(self) -> int:
        """Rows allowed in the next step: the balanced share of the live load.

        Overlapped: ``ceil(min(max_num_seqs, running + waiting) / lanes)`` (lanes = pp_size, or
        fewer with ``adaptive_lanes``: :mod:`ppstate.lanes`), at most
        ``config.max_rows_per_step``. A burst is spread over the ``pp_size`` in-flight batches, and
        when requests finish the lanes (step mod pp_size) re-balance: decode rows above the share
        wait one step and join the next, lighter batch (they keep priority as the oldest eligible).
        Sync: ``max_num_seqs``.
        """
        cfg = self.config
        if cfg.mode == "sync":
            return cfg.max_num_seqs
        return max(1, -(-self._live_share() // self.lanes))

    def _live_share(self) -> int:
        """Live requests (running + waiting), at most max_num_seqs."""
        return min(self.config.max_num_seqs, len(self._running) + len(self._waiting))

    def fire(self, req: Request, trigger: str) -> None:
        """Fire a lifecycle edge on ``req`` and record it in the event sink."""
        state = self.lifecycle.fire(req, trigger)
        if self.sink.enabled:
            self.sink.emit("lifecycle", step=self._next_step, req_id=req.req_id,
                           trigger=trigger, state=state)

    # ---------------------------------------------------------------- results
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

    # ---------------------------------------------------------------- used by RowBuilder
    def running_requests(self) -> list[Request]:
        """Live requests holding a slot, in admission order."""
        return list(self._running.values())

    def pop_waiting(self) -> Request | None:
        """Oldest waiting request (FCFS), or None."""
        return self._waiting.popleft() if self._waiting else None

    def peek_waiting(self) -> Request | None:
        """Oldest waiting request without removing it."""
        return self._waiting[0] if self._waiting else None

    def youngest_running(self, exclude: set[str]) -> Request | None:
        """The most recently admitted running request not in ``exclude`` (preemption victim)."""
        for req in reversed(self._running.values()):
            if req.req_id not in exclude:
                return req
        return None

    def preempt(self, req: Request) -> None:
        """Preempt ``req`` (recompute): blocks and slot freed (FreedSlot in this step's output,
        so workers bump the slot generation and drop its deferred rows), back to the head of
        the waiting queue with its received tokens kept."""
        self.fire(req, "preempt")
        self.kv.free(req)
        slot = self.slots.free(req.req_id)
        self._freed.append(FreedSlot(req.req_id, slot, "preempted"))
        del self._running[req.req_id]
        req.slot = -1
        req.prefill_tokens = req.spec.prompt_token_ids + tuple(req.output_token_ids)
        self._waiting.appendleft(req)
        self.num_preemptions += 1

    def place(self, req: Request, step: int, hit: list[int]) -> NewRequest:
        """Allocate a slot for ``req``, fire ``admit``, give it its prefix-hit blocks ``hit`` and
        initialise its progress arrays (re-admission: prompt + received tokens are prefilled)."""
        req.slot = self.slots.allocate(req.req_id)
        self._admissions += 1
        req.epoch = self._admissions  # unique: stale rows of an earlier request with this id never match
        self.fire(req, "admit")
        cached = self.kv.start(req, hit)
        n_out = len(req.output_token_ids)
        self.arrays.reset(req.slot, len(req.prefill_tokens), req.max_tokens, step, cached, n_out)
        self._running[req.req_id] = req
        return NewRequest(req.req_id, req.slot, req.prefill_tokens,
                          req.prompt_len + req.max_tokens, dict(req.spec.sampling), cached, n_out)


def finish_reason_of(state: str) -> str | None:
    """Client-visible finish reason of a lifecycle state ("stop" | "length" | "abort" | None)."""
    return FINISH_REASONS.get(state)


def arrival_fields(spec: RequestSpec, sink: EventSink, config: SchedulerConfig) -> dict:
    """Fields of the ``arrival`` event of ``spec``: lengths and sampling parameters; prompt
    token ids only when ``sink.trace_prompts``. Without them, and with prefix caching on, the
    chained hashes of the prompt's full blocks (``prefix_hashes``) are recorded instead: they decide
    prefix-cache hits, so replay needs them, and they do not reveal the prompt."""
    ids = list(spec.prompt_token_ids) if sink.trace_prompts else None
    hashes = (block_hashes(spec.prompt_token_ids, config.block_size)
              if ids is None and config.enable_prefix_caching else None)
    return {"req_id": spec.req_id, "prompt_len": spec.prompt_len, "max_tokens": spec.max_tokens,
            "eos_token_ids": sorted(spec.eos_token_ids),
            "stop_token_ids": sorted(spec.stop_token_ids), "ignore_eos": spec.ignore_eos,
            "sampling": dict(spec.sampling), "prompt_token_ids": ids, "prefix_hashes": hashes}
