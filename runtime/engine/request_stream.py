"""Per-request stream state inside the engine: pending increment, detokenizer and timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestStream:
    """One live request as the engine sees it.

    The client's side holds at most one pending increment: an increment queued while the previous
    one is still unread is merged into it (tokens, text and logprobs appended, the later finish
    state kept), as vLLM's output collector does, so a slow reader costs the engine one list
    append per step instead of one queued object, and a reader that keeps up sees one increment
    per step. Waking a waiting reader is one future, created by the reader.

    Attributes:
        req_id: request id.
        params: sampling parameters.
        num_prompt_tokens: prompt length (tokens).
        detok: incremental detokenizer (stop strings, UTF-8 safety).
        num_output_tokens: output tokens queued so far.
        arrival_s / first_token_s: ``time.monotonic()`` of arrival and of the first token.
        scheduled_s: ``time.monotonic()`` of the step that first scheduled it (set by the engine).
        finished: True once the last increment was queued (nothing is queued after it).
        num_cached_tokens: prefix-cache hit of the first admission (tokens; None before it).
        prompt_lps: prompt logprobs received so far, by position (the first entry of each
            position is kept: a recompute after preemption scores the prompt again);
            delivered once, with the first increment.
    """
    req_id: str
    params: SamplingParams
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    num_output_tokens: int = 0
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    scheduled_s: float | None = None
    finished: bool = False
    num_cached_tokens: int | None = None
    prompt_lps: dict[int, TokenLogprob] | None = None
    prompt_delivered: bool = False
    _pending: RequestOutput | None = None
    _waiter: asyncio.Future | None = None

    def add_prompt_logprob(self, position: int, token_id: int, logprob: float,
                           top: dict[int, float]) -> None:
        """Record the logprob of the prompt token at ``position`` (>= 1) and its alternatives."""
        if self.prompt_delivered:
            return
        if self.prompt_lps is None:
            self.prompt_lps = {}
        self.prompt_lps.setdefault(position, TokenLogprob(token_id, logprob, top))

    def _take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        if self.prompt_delivered or self.params.prompt_logprobs is None:
            return None
        self.prompt_delivered = True
        got = self.prompt_lps or {}
        self.prompt_lps = None
        return [None] + [got.get(p) for p in range(1, self.num_prompt_tokens)]

    def push_tokens(self, token_ids: list[int], finish_reason: str | None,
                    logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Detokenize ``token_ids`` and queue one increment (merged into an unread one).

        Args:
            token_ids: the request's new tokens; the increment keeps this list (pass a fresh one).

        Returns:
            The finish reason after stop strings were checked ("stop" when a stop string matched,
            otherwise ``finish_reason``).
        """
        if self.finished:
            return finish_reason
        first = self.first_token_s is None and bool(token_ids)
        if first:
            self.first_token_s = time.monotonic()
        detok = self.detok
        text, kept = detok.push_counted(token_ids)
        if kept < len(token_ids):  # a stop string ended inside a run of accepted drafts
            token_ids = token_ids[:kept]
            logprobs = None if logprobs is None else logprobs[:kept]
        if detok.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += detok.flush()
        n = self.num_output_tokens = self.num_output_tokens + len(token_ids)
        done = self.finished = finish_reason is not None
        prev = self._pending
        if prev is None:
            self._pending = RequestOutput(self.req_id, token_ids, text, done, finish_reason,
                                          self.num_prompt_tokens, n, logprobs,
                                          num_cached_tokens=self.num_cached_tokens or 0,
                                          prompt_logprobs=self._take_prompt_logprobs())
        else:
            prev.new_token_ids += token_ids
            prev.new_text += text
            if logprobs is not None or prev.logprobs is not None:
                prev.logprobs = (prev.logprobs or []) + (logprobs or [])
            prev.finished, prev.finish_reason, prev.num_output_tokens = done, finish_reason, n
            if prev.prompt_logprobs is None:
                prev.prompt_logprobs = self._take_prompt_logprobs()
        if first and self.scheduled_s is not None:   # the queue time rides on the first tokens
            out = self._pending
            out.scheduled_s, out.queue_s = self.scheduled_s, self.scheduled_s - self.arrival_s
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        return finish_reason

    def finish(self, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        """Queue the final (token-less) increment: abort, request failure or engine failure
        (``error_kind`` ``"request"`` / ``"engine"``, see :mod:`runtime.engine.faults`)."""
        if self.finished:
            return
        self._put(RequestOutput(self.req_id, [], "", True, reason, self.num_prompt_tokens,
                                self.num_output_tokens, None, error, error_kind,
                                self.num_cached_tokens or 0))

    def _put(self, out: RequestOutput) -> None:
        self.finished = out.finished
        prev = self._pending
        if prev is None:
            self._pending = out
        else:
            merge_into(prev, out)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> RequestOutput:
        """The next increment (all increments queued since the last call, merged); waits for
        one when none is pending."""
        while (out := self._pending) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._pending = None
        return out

    async def iterate(self, on_close) -> AsyncIterator[RequestOutput]:
        """Yield increments until the finished one (:meth:`get` inlined: one frame less per
        increment). ``on_close`` runs if the consumer leaves early (client disconnect): it
        aborts the request."""
        done = False
        loop = asyncio.get_running_loop()
        try:
            while not done:
                while (out := self._pending) is None:
                    self._waiter = loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                self._pending = None
                done = out.finished  # closing the stream after the last increment is no abort
                yield out
        finally:
            if not done:
                await on_close(self.req_id)


def merge_into(prev: RequestOutput, out: RequestOutput) -> None:
    """Append increment ``out`` to the unread increment ``prev`` (in place): token ids, text and
    logprobs concatenated; counts, finish state and error taken from ``out``."""
    prev.new_token_ids += out.new_token_ids
    prev.new_text += out.new_text
    if out.logprobs is not None or prev.logprobs is not None:
        prev.logprobs = (prev.logprobs or []) + (out.logprobs or [])
    prev.finished, prev.finish_reason = out.finished, out.finish_reason
    prev.num_output_tokens = out.num_output_tokens
    prev.error, prev.error_kind = out.error, out.error_kind
    prev.num_cached_tokens = out.num_cached_tokens
