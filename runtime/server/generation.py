"""One request's life in the server: submit to the engine, stream or collect, abort on early exit.

``Generation.start`` submits synchronously, so an engine rejection becomes an HTTP 400 before any
byte of a stream is sent. Every exit path that leaves the request unfinished (client disconnect,
cancellation, server error) goes through ``Generation.close``, which aborts it in the engine so its
slot is freed at once; ``close`` is idempotent and shielded from cancellation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.engine import EngineDeadError, RequestRejected
from runtime.engine.faults import REQUEST, SHUTDOWN, RequestFailure
from runtime.engine.outputs import RequestOutput, TokenLogprob
from runtime.sampling_params import SamplingParams
from runtime.server.errors import APIError
from runtime.server.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger("runtime.server")
ABORT_TIMEOUT_S = 10.0


@dataclass
class Collected:
    """A finished request, gathered for a non-streamed response (counts in tokens)."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "abort"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the sampled tokens' logprobs (``best_of`` ranks by it)."""
        return sum(e.logprob for e in self.logprobs)


class Generation:
    """Drives one engine request and records its latency metrics."""

    def __init__(self, engine: Any, metrics: ServerMetrics, req_id: str, prompt_ids: list[int],
                 params: SamplingParams, prompt_field: str, arrival: float,
                 fork_of: str | None = None) -> None:
        self.engine = engine
        self.fork_of = fork_of  # the request whose prompt KV blocks this one shares (n > 1)
        self.req_id = req_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.prompt_field = prompt_field
        self.created = int(time.time())
        self.timer = RequestTimer(metrics, arrival)
        self.metrics = metrics
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._finished = False
        self._closed = False

    def start(self) -> None:
        """Submit to the engine. Raises APIError (400 for rejected input, 503 for a dead engine)."""
        try:
            extra = {} if self.fork_of is None else {"fork_of": self.fork_of}
            self._stream = aiter(self.engine.add_request(self.req_id, self.prompt_ids, self.params,
                                                         **extra))
        except RequestRejected as exc:
            field_name = getattr(exc, "field", None) or self.prompt_field
            if field_name == "prompt":
                field_name = self.prompt_field
            raise APIError(getattr(exc, "message", None) or str(exc), param=field_name,
                           code="invalid_value") from None
        except RequestFailure as exc:
            raise request_failed(str(exc)) from None
        except EngineDeadError as exc:
            raise APIError(f"The engine is not running: {exc}", status=503,
                           type="service_unavailable", code="engine_dead") from None
        self.metrics.admitted(len(self.prompt_ids), self.params.max_tokens)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's increments until the final one.

        Raises:
            APIError: 503 ``engine_error`` when the engine failed (a rank died, hung or erred:
                the engine is down, the client may retry once it is back); 503
                ``server_shutting_down`` when the server is stopping and ended the request; 500
                ``request_failed`` when only this request's own work failed.
        """
        assert self._stream is not None, "start() first"
        done = False
        async for out in self._stream:
            if done:
                continue  # nothing follows the final increment; resuming lets the stream end itself
            if out.error is not None:
                self._finished = True
                self.timer.on_abort(observe_e2e=False)
                if out.error_kind == REQUEST:
                    raise request_failed(out.error)
                if out.error_kind == SHUTDOWN:
                    raise APIError(f"The request was ended because {out.error}; retry on another "
                                   "server or once this one is back.", status=503,
                                   type="service_unavailable", code="server_shutting_down")
                raise APIError(f"The engine failed while generating: {out.error}", status=503,
                               type="service_unavailable", code="engine_error")
            self.timer.on_output(out)
            if out.finished:
                self._finished = True
            yield out
            done = out.finished
        if not self._finished:  # the stream ended without a final increment
            self._finished = True
            raise APIError("The engine ended the request without a result.", status=500,
                           type="internal_server_error", code="engine_error")

    async def collect(self) -> Collected:
        """Run to completion and gather text, ids and logprobs (non-streamed responses)."""
        res = Collected(num_prompt_tokens=len(self.prompt_ids))
        async for out in self.outputs():
            res.text += out.new_text
            res.token_ids.extend(out.new_token_ids)
            if out.logprobs:
                res.logprobs.extend(out.logprobs)
            res.num_prompt_tokens = out.num_prompt_tokens or res.num_prompt_tokens
            res.num_output_tokens = out.num_output_tokens
            res.num_cached_tokens = out.num_cached_tokens or res.num_cached_tokens
            if out.prompt_logprobs is not None:
                res.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                res.finish_reason = out.finish_reason or "stop"
        return res

    async def collect_unless_disconnected(self, receive: Receive) -> Collected | None:
        """``collect`` while watching the connection; None (request aborted) if the client left."""
        result: list[Collected] = []
        failed: list[APIError] = []

        async def run(cancel: anyio.CancelScope) -> None:
            try:
                result.append(await self.collect())
            except APIError as exc:
                failed.append(exc)
            cancel.cancel()

        async def watch(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, tg.cancel_scope)
                tg.start_soon(watch, tg.cancel_scope)
        finally:
            await self.close()
        if failed:
            raise failed[0]
        return result[0] if result else None

    async def _close_stream(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
                await aclose()

    async def close(self) -> None:
        """Abort the request in the engine unless it finished (idempotent, cancellation-shielded)."""
        if self._closed:
            return
        self._closed = True
        if self._stream is None:
            return
        if not self._finished:
            self._finished = True
            self.timer.on_abort()
            with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
                try:
                    await self.engine.abort(self.req_id)
                except Exception:
                    logger.exception("abort of %s failed", self.req_id)
        await self._close_stream()


def request_failed(message: str) -> APIError:
    """HTTP 500 ``request_failed``: this request alone failed inside the server (see
    :mod:`runtime.engine.faults`); the engine and the other requests keep running."""
    return APIError(f"{message} (only this request failed; the server keeps serving)", status=500,
                    type="internal_server_error", code="request_failed")


class GenerationStreamResponse(StreamingResponse):
    """An SSE response whose request is aborted in the engine however the response ends
    (``generation``: a :class:`Generation`, or anything with its ``close``, e.g. the
    :class:`~runtime.server.choices.Choices` of several)."""

    def __init__(self, content: AsyncIterator[str], generation: Generation) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.generation.close()


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload (or ``[DONE]``)."""
    return f"data: {payload}\n\n"
