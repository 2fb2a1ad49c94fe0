"""Per-request stream state inside the engine: the client's queue, detokenizer and timings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.sampling_params import SamplingParams


@dataclass
class RequestStream:
    """One live request as the engine sees it.

    Attributes:
        req_id: request id.
        params: sampling parameters.
        num_prompt_tokens: prompt length (tokens).
        detok: incremental detokenizer (stop strings, UTF-8 safety).
        queue: increments for the client; a finished increment is always the last one.
        arrival_s / first_token_s: ``time.monotonic()`` of arrival and of the first token.
    """
    req_id: str
    params: SamplingParams
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finished: bool = False

    def push_tokens(self, token_ids: list[int], finish_reason: str | None,
                    logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Detokenize ``token_ids`` and queue one increment.

        Returns:
            The finish reason after stop strings were checked ("stop" when a stop string matched,
            otherwise ``finish_reason``).
        """
        if self.finished:
            return finish_reason
        if self.first_token_s is None and token_ids:
            self.first_token_s = time.monotonic()
        text = self.detok.push(token_ids)
        if self.detok.stopped:
            finish_reason = "stop"
        elif finish_reason is not None:
            text += self.detok.flush()
        self.num_output_tokens += len(token_ids)
        self._put(RequestOutput(self.req_id, list(token_ids), text, finish_reason is not None,
                                finish_reason, self.num_prompt_tokens, self.num_output_tokens,
                                logprobs))
        return finish_reason

    def finish(self, reason: str, error: str | None = None, error_kind: str | None = None) -> None:
        """Queue the final (token-less) increment: abort, request failure or engine failure
        (``error_kind`` ``"request"`` / ``"engine"``, see :mod:`runtime.engine.faults`)."""
        if self.finished:
            return
        self._put(RequestOutput(self.req_id, [], "", True, reason, self.num_prompt_tokens,
                                self.num_output_tokens, None, error, error_kind))

    def _put(self, out: RequestOutput) -> None:
        self.finished = out.finished
        self.queue.put_nowait(out)

    async def iterate(self, on_close) -> AsyncIterator[RequestOutput]:
        """Yield increments until the finished one. ``on_close`` runs if the consumer leaves
        early (client disconnect): it aborts the request."""
        done = False
        try:
            while True:
                out = await self.queue.get()
                done = out.finished  # closing the stream after the last increment is no abort
                yield out
                if done:
                    return
        finally:
            if not done:
                await on_close(self.req_id)
