"""Delivery of one step's result to the request streams (owned by the :class:`AsyncEngine`).

:meth:`ResultDelivery.note_admitted` marks, when a step is issued, the queue time and prefix-cache
hit of the requests it admits for the first time.
:class:`ResultDelivery` turns the last rank's :class:`~ppstate.batch.StepResult` into per-request
stream increments: it hands the result to the scheduler, lets the engine issue the next step
before the streams are served, then pushes each request's tokens (and logprobs, prompt logprobs)
to its stream. A failure inside one request's own work (its logprobs, detokenizing, stop
strings) ends that request only (:mod:`runtime.engine.faults`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from ppstate.batch import NewRequest
from ppstate.scheduler import Scheduler
from runtime.engine.counters import EngineCounters
from runtime.engine.faults import REQUEST, RequestFailure
from runtime.engine.outputs import logprob_index, logprobs_for, update_rows
from runtime.engine.request_stream import RequestStream


class ResultDelivery:
    """Serves the streams from step results.

    Args:
        sched: the engine's scheduler.
        streams: the engine's live streams by request id (shared: entries end here).
        step_rows: request ids of each issued step's rows, by step (shared: popped here).
        counters: the engine's counters (steps and tokens).
        wake: the event that wakes the engine's step loop.
        issue_steps: the engine's issuing of steps (called before the streams are served).
    """

    def __init__(self, sched: Scheduler, streams: dict[str, RequestStream],
                 step_rows: dict[int, tuple[str, ...]], counters: EngineCounters,
                 wake: asyncio.Event, issue_steps: Callable[[], None]) -> None:
        self.sched, self.streams, self.step_rows = sched, streams, step_rows
        self.counters, self.wake, self.issue_steps = counters, wake, issue_steps

    def note_admitted(self, new_requests: Sequence[NewRequest]) -> None:
        """Record on their streams the queue time (``vllm:request_queue_time_seconds``) and the
        prefix-cache hit (usage) of the first admission of ``new_requests``."""
        for new in new_requests:   # queue time (vllm:request_queue_time_seconds)
            stream = self.streams.get(new.req_id)
            if stream is not None and stream.scheduled_s is None:
                stream.scheduled_s = time.monotonic()
        for new in new_requests:   # prefix-cache hit of the first admission (usage)
            if (stream := self.streams.get(new.req_id)) is not None and \
                    stream.num_cached_tokens is None:
                stream.num_cached_tokens = new.num_cached_tokens

    def on_result(self, result) -> None:
        """Deliver one step's tokens to their streams. A request's own failure (its logprobs,
        detokenizing, stop strings) ends that request only (:mod:`runtime.engine.faults`); the
        stage is named without a context manager per row (two per row per step were ~7% of the
        engine's time at 256 rows)."""
        self.counters.steps_total += 1
        rows = self.step_rows.pop(result.step, ())
        row_of = logprob_index(result, rows)
        streams, tokens = self.streams, 0
        if result.prompt_logprobs is not None:
            self.push_prompt_logprobs(result.prompt_logprobs, rows)
        updates = self.sched.on_step_result(result)
        # The next step goes out before the streams are served: the ranks compute it while this
        # process detokenizes and wakes the clients (a stop string found below stops its
        # request one step later, as an in-flight step does in overlapped mode).
        self.issue_steps()
        for req_id, token_ids, finish_reason in update_rows(updates):
            stream = streams.get(req_id)
            if stream is None:
                continue
            stage, before = "logprobs", stream.num_output_tokens
            try:
                lps = None if row_of is None else logprobs_for(result, row_of, req_id, token_ids)
                stage = "detokenize"
                reason = stream.push_tokens(token_ids, finish_reason, lps)
            except Exception as exc:  # noqa: BLE001 - this request's own data only
                self.fail_request(RequestFailure(req_id, stage, exc))
                continue
            # delivered tokens: a stop string inside an accepted draft run drops the rest
            tokens += stream.num_output_tokens - before
            if reason is not None:
                if finish_reason is None:  # stop string found by the detokenizer
                    self.sched.stop(req_id)
                del streams[req_id]
        self.counters.tokens_total += tokens
        self.wake.set()

    def push_prompt_logprobs(self, plps, rows: tuple[str, ...]) -> None:
        """Hand each stream the prompt logprobs its prefill rows scored in one step
        (:class:`~runtime.sampling.step_logprobs.PromptLogprobs`); a failure ends that request."""
        for j in range(plps.rows.shape[0]):
            req_id = rows[int(plps.rows[j])]
            stream = self.streams.get(req_id)
            if stream is None:
                continue
            try:
                stream.add_prompt_logprob(*plps.entry(j))
            except Exception as exc:  # noqa: BLE001 - this request's own data only
                self.fail_request(RequestFailure(req_id, "logprobs", exc))

    def fail_request(self, failure: RequestFailure) -> None:
        """End one request after a :class:`RequestFailure`: free its slot, close its stream with
        ``error_kind`` ``"request"``; the engine and the other requests go on."""
        stream = self.streams.pop(failure.req_id, None)
        if self.sched.abort(failure.req_id):
            self.wake.set()
        if stream is not None:
            stream.finish("abort", error=str(failure), error_kind=REQUEST)
