"""Continuous-batching scheduler for a pipeline of ``pp_size`` stages.

Per step (:meth:`Scheduler.schedule`): eligible decode rows first (a request that sampled at step t
is eligible again at t + cadence, optimistically, before t's result has arrived), then continuing
prefill chunks (one request's chunks go in consecutive steps), then FCFS admission of waiting
requests into free slots, all within ``max_num_batched_tokens``, ``max_prefill_chunk`` and the
balanced-admission row cap. Its only output is a :class:`~ppstate.batch.SchedulerOutput`.
Results come back in step order through :meth:`Scheduler.on_step_result`.

Files: this one (the client side, :meth:`Scheduler.schedule`), and the objects it owns and
hands to each other as fields: ``slot_views`` (slot-indexed views of the running requests),
``scheduler_queues`` (the request queues: admission, preemption, finishing), ``scheduler_rows``
(the row builder of one step) and ``scheduler_results`` (the steps in flight and their results).
Lifecycle edges go through :class:`~ppstate.lifecycle.Lifecycle`; per-token counters live in
:class:`~ppstate.budget.RequestArrays`; KV blocks in :class:`~ppstate.kv_manager.KVManager` (taken
when a row is scheduled; when a running request cannot get one, the youngest running request is
preempted and later recomputed). Sources: vLLM V1 ``core/sched/scheduler.py`` +
``async_scheduler.py`` (PP throttle) and Model Runner V2 "Avoid pipeline parallel bubbles".
"""

from __future__ import annotations

from collections.abc import Sequence

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.budget import RequestArrays, SchedulerConfig, StepBudget
from ppstate.errors import SchedulerError
from ppstate.events import NULL_SINK, EventSink
from ppstate.kv_manager import KVManager
from ppstate.lanes import choose_lanes, lane_open, lane_token_budget
from ppstate.lifecycle import Lifecycle
from ppstate.request import Request, RequestSpec, TokenUpdate
from ppstate.scheduler_queues import FINISHED_HISTORY, RequestQueues
from ppstate.scheduler_results import StepResults
from ppstate.scheduler_rows import RowBuilder
from ppstate.slot_views import SlotViews
from ppstate.slots import SlotTable
from ppstate.speculative_probe import NgramProbe
from ppstate.step_updates import StepUpdates
from ppstate.codec import arrival_fields, encode_output

__all__ = ["Scheduler", "SchedulerConfig", "RequestSpec", "TokenUpdate", "FINISHED_HISTORY"]


class Scheduler:
    """Continuous batching over ``config.max_num_seqs`` slots.

    Owns, and passes to each other as fields: the slot views (:attr:`views`,
    :class:`~ppstate.slot_views.SlotViews`), the request queues (:attr:`queues`,
    :class:`~ppstate.scheduler_queues.RequestQueues`: admission, preemption, finishing), the
    result handler (:attr:`results`, :class:`~ppstate.scheduler_results.StepResults`: the steps
    in flight); each step's rows come from a :class:`~ppstate.scheduler_rows.RowBuilder`.

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
        self.speculative_probe = (NgramProbe(config.spec_probe_ngram)      # issue #33
                           if config.num_spec_tokens and config.spec_probe_ngram else None)
        self.lifecycle = Lifecycle()
        self.kv = KVManager(config)
        self.num_prefill_tokens = 0   # prefill tokens scheduled (computed), prefix hits excluded
        self.views = SlotViews(config.max_num_seqs, config.max_model_len)
        self.queues = RequestQueues(self.arrays, self.slots, self.kv, self.views, self.lifecycle,
                                    self.fire)
        self.results = StepResults(config, self.arrays, self.views, self.queues)
        self._next_step = 0
        self._arrivals = 0   # requests added so far: the next one's Request.order
        self.lanes = config.pp_size  # lanes filled with decode rows this step (ppstate.lanes)

    # ---------------------------------------------------------------- queries
    @property
    def in_flight(self) -> int:
        """Steps issued whose StepResult has not arrived."""
        return len(self.results.in_flight)

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far."""
        return self.queues.num_preemptions

    @property
    def num_discarded_rows(self) -> int:
        """Sampled rows whose request had left the slot (dropped), so far."""
        return self.results.num_discarded_rows

    @property
    def next_step(self) -> int:
        """Number the next issued step will get."""
        return self._next_step

    def has_unfinished(self) -> bool:
        """True while some request is waiting or holds a slot."""
        return bool(self.queues.waiting or self.queues.running)

    def is_live(self, req_id: str) -> bool:
        """True while ``req_id`` is waiting or holds a slot (its id cannot be added again)."""
        return req_id in self.queues.live

    def running_requests(self) -> list[Request]:
        """Live requests holding a slot, in admission order."""
        return self.queues.running_requests()

    def peek_waiting(self) -> Request | None:
        """Oldest waiting request (FCFS), or None."""
        return self.queues.peek_waiting()

    def preempt(self, req: Request) -> None:
        """Preempt running ``req`` (:meth:`RequestQueues.preempt
        <ppstate.scheduler_queues.RequestQueues.preempt>`)."""
        self.queues.preempt(req)

    def state_of(self, req_id: str) -> str:
        """Lifecycle state of ``req_id``: a live request's, or the final state of one of the
        ``FINISHED_HISTORY`` most recently finished requests.

        Raises:
            SchedulerError: unknown id (never seen, or finished longer ago than that).
        """
        req = self.queues.live.get(req_id)
        if req is not None:
            return req.state
        if req_id in self.queues.finished:
            return self.queues.finished[req_id]
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
        if rid in self.queues.live:
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
        self.results.add_stop_ids(spec)
        req = Request(spec, max_tokens, self.arrays, self._arrivals)
        self._arrivals += 1
        self.lifecycle.add(req)
        self.queues.waiting.append(req)
        self.queues.live[rid] = req

    def abort(self, req_id: str) -> bool:
        """Abort ``req_id`` now; its slot is freed (FreedSlot in the next output).

        Returns:
            False when the id is unknown or the request already finished.
        """
        if self.sink.enabled:
            self.sink.emit("abort", step=self._next_step, req_id=req_id)
        req = self.queues.live.get(req_id)
        if req is None:
            return False
        if req.slot < 0:
            self.queues.waiting.remove(req)
        self.queues.finish(req, "abort")
        return True

    def stop(self, req_id: str) -> bool:
        """External stop (e.g. a stop string found by the engine): decoding -> finished_stopped.

        Returns:
            False unless ``req_id`` is decoding.
        """
        if self.sink.enabled:
            self.sink.emit("stop", step=self._next_step, req_id=req_id)
        req = self.queues.running.get(req_id)
        if req is None or req.state != "decoding":
            return False
        self.queues.finish(req, "stop")
        return True

    # ---------------------------------------------------------------- scheduling
    def schedule(self) -> SchedulerOutput | None:
        """Issue the next step.

        Step numbers are the pipeline's beats (step s belongs to lane s mod pp_size, a decode
        row is eligible again ``cadence`` numbers later). A step that would carry nothing
        (:attr:`~ppstate.batch.SchedulerOutput.carries_nothing`: no row, e.g. a closed lane of
        adaptive lanes or the cadence gap of a few requests) is not issued: its number is
        skipped and the next one tried, at most ``2 * pp_size - 1`` numbers (a decoding
        request is eligible within ``cadence <= pp_size`` numbers, then waits at most
        ``pp_size - 1`` for an open lane; nothing else depends on the number). The ranks
        rotate their PPHandler FIFOs over skipped numbers (:class:`~ppstate.rank_step.RankStep`),
        so deferred consumes stay ``depth`` numbers after their step. The in-flight window
        counts numbers: a step is issued only while its number is below the oldest unanswered
        step's + ``in_flight_limit`` (with no number skipped: ``in_flight < in_flight_limit``).

        Returns:
            None when the window is full, nothing needs delivering and no live request can get
            a row before more results arrive, or none of the numbers tried would carry
            anything (then no number is used up). Otherwise the step's output: rows, or only
            ``freed`` (and block-table deltas) to deliver.
        """
        if not (self.queues.waiting or self.queues.freed) and self._all_awaiting_results():
            return None
        first, limit = self._next_step, self.config.in_flight_limit
        in_flight = self.results.in_flight
        for step in range(first, first + 2 * self.config.pp_size - 1):
            if in_flight and step - in_flight[0].step >= limit:
                break
            self._next_step = step   # lifecycle events of this step are stamped with it
            if (out := self._build(step)) is not None:
                return out
        self._next_step = first      # nothing issued: a skipped number changed no state
        return None

    def _build(self, step: int) -> SchedulerOutput | None:
        """Build step ``step`` and issue it, or None when it would carry nothing (then it
        changed nothing but :attr:`lanes`: no row took a block, no request was admitted or
        preempted). A lane that adaptive lanes keep closed carries nothing (:mod:`ppstate.lanes`;
        its freed slots wait for the next open lane's step)."""
        cfg = self.config
        self.lanes = choose_lanes(cfg, self._live_share())  # issue 11: adaptive lanes
        if not lane_open(step, self.lanes, cfg.pp_size):
            return None
        rows = RowBuilder(cfg, self.arrays, self.kv, self.views, self.queues, self.fire,
                          self.speculative_probe, step,
                          StepBudget(lane_token_budget(cfg, self.lanes), self.row_cap()))
        rows.add_decodes()
        rows.add_continuing_prefills()
        rows.admit_waiting()
        self.num_prefill_tokens += rows.num_prefill_tokens
        deltas = self.kv.take_deltas()
        self.kv.digests.apply([n.slot for n in rows.new], *deltas)   # nothing when it carries nothing
        out = rows.build(tuple(self.queues.freed), deltas, self.kv.digests)
        if out.carries_nothing:
            return None
        self.queues.freed = []
        self._next_step = step + 1
        self.results.issue(out, rows.row_epochs, rows.row_drafts)
        if self.sink.enabled:
            self.sink.emit("schedule", step=step,
                           output=encode_output(out, self.sink.trace_prompts))
        return out

    def _all_awaiting_results(self) -> bool:
        """True when no live request can get a row before more results arrive (or none is live):
        every one has all its max_tokens sampling rows in flight."""
        rows, most = self.arrays.num_sampling_rows, self.arrays.max_tokens
        for r in self.queues.running.values():  # the oldest one usually answers
            if r.state != "decoding" or rows.item(r.slot) < most.item(r.slot):
                return False
        return True

    def kv_stats(self) -> dict[str, float | int]:
        """KV-cache counters: blocks (total / free incl. cached / cached), prefix-cache lookups
        and hits (tokens), hit rate, preemptions and prefill tokens computed so far."""
        pool = self.kv.pool
        return {"kv_blocks_total": pool.num_blocks, "kv_blocks_free": pool.num_free,
                "kv_blocks_cached": pool.num_cached, "prefix_cache_query_tokens": pool.query_tokens,
                "prefix_cache_hit_tokens": pool.hit_tokens, "prefix_cache_hit_rate": pool.hit_rate,
                "num_preemptions": self.num_preemptions,
                "discarded_result_rows": self.num_discarded_rows,
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
        return min(self.config.max_num_seqs, len(self.queues.running) + len(self.queues.waiting))

    def on_step_result(self, result: StepResult) -> Sequence[TokenUpdate]:
        """Apply the last rank's output of the oldest in-flight step.

        Rows of requests no longer live, rows scheduled before a preemption of their request,
        and non-final prefill chunks are ignored. A request stops at the first EOS (unless
        ignore_eos) or stop token id, or at max_tokens; its slot is freed then.

        Returns:
            One TokenUpdate per live sampling row with ``num_sampled > 0``, in row order (a
            :class:`~ppstate.step_updates.StepUpdates`, or a list with speculative drafts).

        Raises:
            SchedulerError: not the oldest in-flight step, or a row count that differs.
        """
        if self.sink.enabled:
            self.sink.emit("result", step=self._next_step, of_step=result.step,
                           token_ids=result.sampled_token_ids.tolist(),
                           num_sampled=result.num_sampled.tolist(),
                           num_rejected=result.num_rejected.tolist())
        updates, discarded = self.results.apply(result)
        if self.sink.enabled:
            self.sink.emit("tokens", step=self._next_step, of_step=result.step, discarded=discarded,
                           updates=updates.as_dicts() if isinstance(updates, StepUpdates)
                           else [vars(u) for u in updates])
        return updates

    def spec_stats(self) -> dict[str, int]:
        """Speculative decoding counters (:meth:`StepResults.spec_stats
        <ppstate.scheduler_results.StepResults.spec_stats>`)."""
        return self.results.spec_stats()

    def fire(self, req: Request, trigger: str) -> None:
        """Fire a lifecycle edge on ``req`` and record it in the event sink."""
        state = self.lifecycle.fire(req, trigger)
        if self.sink.enabled:
            self.sink.emit("lifecycle", step=self._next_step, req_id=req.req_id,
                           trigger=trigger, state=state)

