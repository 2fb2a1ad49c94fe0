"""The two generation endpoints: request -> token ids + SamplingParams -> response or SSE stream.

Length rules (tokens): a prompt must be shorter than ``max_model_len``; an explicit ``max_tokens``
must fit in what is left (``prompt + max_tokens <= max_model_len``), else HTTP 400 naming the field.
Without ``max_tokens`` a completion gets 16 tokens and a chat reply the rest of the context window.

Value rules that need the model (docs/server.md has the full table): token ids (``prompt``,
``stop_token_ids``) must be in ``[0, vocab_size)``; ``top_k`` of -1, 0 or >= ``vocab_size`` means no
cut (clamped to -1, the engine's "off"); ``seed: -1`` means unseeded. Tokenizing (and rendering the
chat template) runs in a request scope (:mod:`runtime.engine.faults`): its failure is a 400 naming the
field, never a server error.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.config import EngineConfig
from runtime.engine.faults import RequestFailure, request_scope
from runtime.sampling_params import SamplingParams
from runtime.server import responses as R
from runtime.server.errors import APIError
from runtime.server.chat import chat_completions
from runtime.server.completions import completions as multi_completions, is_plain
from runtime.server.generation import Generation, GenerationStreamResponse, sse
from runtime.server.metrics import ServerMetrics
from runtime.server.chat_tools import ToolMode
from runtime.server.schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from runtime.server.structured import StructuredCompiler, requested

DEFAULT_COMPLETION_TOKENS = 16
#: temperatures below this are served greedily (as vLLM does): dividing logits by ~0 overflows
MIN_TEMPERATURE = 1e-5


class OpenAIHandlers:
    """Serves /v1/completions and /v1/chat/completions for one engine."""

    def __init__(self, engine: Any, config: EngineConfig, metrics: ServerMetrics,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        #: ``--reasoning-parser``: split chat replies into reasoning_content / content
        self.reasoning_parser = reasoning_parser
        self.model_name: str = engine.model_name
        self.vocab_size: int | None = getattr(engine.tokenizer, "vocab_size", None)
        self.structured = StructuredCompiler(engine.tokenizer,   # grammar cache (docs/structured.md)
                                             getattr(engine, "warm_grammar", None))

    # ---- request -> engine inputs -------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """Accept ``default``, the served name, or no model at all."""
        if name is not None and name not in ("default", self.model_name):
            raise APIError(f"The model '{name}' does not exist. This server serves "
                           f"'{self.model_name}' (also available as 'default').",
                           param="model", code="model_not_found")

    def output_limit(self, requested: int | None, default: int | None, prompt_len: int,
                     prompt_field: str, limit_field: str) -> int:
        """Output tokens to allow; raises 400 when the prompt or the request does not fit."""
        max_len, room = self.config.scheduler.max_model_len, self.config.scheduler.output_room(prompt_len)
        if room < 1:
            raise APIError(f"'{prompt_field}' is too long: this model's maximum context length is "
                           f"{max_len} tokens and the prompt has {prompt_len} tokens, leaving no room "
                           "for output.",
                           param=prompt_field, code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(f"'{limit_field}' is too large: this model's maximum context length is "
                           f"{max_len} tokens, you requested {prompt_len + requested} tokens "
                           f"({prompt_len} in the prompt, {requested} for the completion); "
                           f"use {limit_field} <= {room}.",
                           param=limit_field, code="context_length_exceeded")
        return requested

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Token ids must be inside the vocabulary."""
        if self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise APIError(f"Invalid value for '{param}': token ids must be < {self.vocab_size} "
                           "(the vocabulary size)", param=param,
                           code="invalid_value")

    def top_k(self, top_k: int | None) -> int:
        """The engine's top_k: -1 (no cut) for null, -1, 0 and anything >= the vocabulary size
        (keeping every token is no cut, as in vLLM and OpenAI-style servers)."""
        if top_k is None or top_k <= 0 or (self.vocab_size is not None and top_k >= self.vocab_size):
            return -1
        return top_k

    def sampling_params(self, req: GenerationRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams from the OpenAI fields (null means the OpenAI default; a temperature
        below ``MIN_TEMPERATURE`` means greedy; ``seed: -1`` means unseeded)."""
        stop_ids = req.stop_token_ids or []
        self.check_token_ids(stop_ids, "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else
            (0.0 if req.temperature < MIN_TEMPERATURE else req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=self.top_k(req.top_k),
            seed=None if req.seed in (None, -1) else req.seed, stop=req.stop_list, stop_token_ids=stop_ids,
            ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=self.logit_bias(req.logit_bias))

    def logit_bias(self, bias: dict[str, float] | None) -> list[tuple[int, float]]:
        """``logit_bias`` as ``[(token id, bias)]``; 400 naming the key of an id outside the
        vocabulary (the schema checked the keys' form and the values' range)."""
        pairs = [(int(k), float(v)) for k, v in (bias or {}).items()]
        for tid, _ in pairs:
            if self.vocab_size is not None and tid >= self.vocab_size:
                raise APIError(f"Invalid value for 'logit_bias': token id {tid} is not in the "
                               f"vocabulary (ids < {self.vocab_size})", param=f"logit_bias.{tid}",
                               code="invalid_value")
        return pairs

    async def constrain(self, req: GenerationRequest, params: SamplingParams,
                        tools: ToolMode | None = None) -> SamplingParams:
        """``params`` with the request's structured-output constraint (compiled off the event
        loop). Raises APIError: 400 naming the field for a constraint that does not compile, two
        constraints, or a tool_choice that conflicts with one."""
        found = requested(req)
        from_tools = tools.constraint() if tools is not None else None
        if from_tools is not None and found is not None:
            raise APIError(f"'{found[1]}' cannot be combined with tool_choice {tools.choice!r} "
                           "(which constrains the output itself).", param=found[1],
                           code="invalid_value")
        found = found or from_tools
        if found is None:
            return params
        await self.structured.check(*found)
        return params.model_copy(update={"structured": found[0]})

    async def tokenize(self, req_id: str, field: str, fn, *args, **kwargs) -> list[int]:
        """``fn(*args, **kwargs)`` (a tokenizer call) in a worker thread and a request scope.

        Raises:
            APIError: 400 naming ``field`` when tokenizing or rendering the template fails.
        """
        try:
            with request_scope(req_id, "tokenize"):
                return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
        except RequestFailure as exc:
            cause = exc.cause
            detail = (str(cause) if isinstance(cause, ValueError) else
                      f"tokenizing it failed: {type(cause).__name__}: {cause}")
            raise APIError(f"Invalid value for '{field}': {detail}", param=field,
                           code="invalid_value") from None

    def token_text(self, as_ids: bool):
        """Token id -> the string shown in logprobs (``token_id:N`` with return_tokens_as_token_ids)."""
        if as_ids:
            return lambda i: f"token_id:{i}"
        decode = self.engine.tokenizer.decode
        return lambda i: decode([i])

    def text_offsets(self) -> R.TextOffsets:
        """A fresh :class:`~runtime.server.responses.TextOffsets` for one response."""
        tok = self.engine.tokenizer
        return R.TextOffsets(tok.token_bytes, tok.is_special)

    # ---- endpoints ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self.check_model(req.model)
        if not is_plain(req):   # batched prompts, n / best_of, echo (runtime/server/completions.py)
            return await multi_completions(self, req, request)
        req_id = f"cmpl-{uuid.uuid4().hex}"
        prompt = req.prompts[0]
        if isinstance(prompt, str):
            ids = await self.tokenize(req_id, "prompt", self.engine.tokenizer.encode, prompt)
        else:
            ids = list(prompt)
            self.check_token_ids(ids, "prompt")
        limit = self.output_limit(req.max_tokens, DEFAULT_COMPLETION_TOKENS, len(ids), "prompt", "max_tokens")
        params = await self.constrain(req, self.sampling_params(req, limit, req.logprobs))
        gen = Generation(self.engine, self.metrics, req_id, ids, params, "prompt", arrival)
        gen.start()
        token_text = self.token_text(bool(req.return_tokens_as_token_ids))
        if req.stream:
            return GenerationStreamResponse(self._completion_sse(gen, req, token_text), gen)
        res = await gen.collect_unless_disconnected(request.receive)
        if res is None:
            return Response(status_code=499)
        lp = None
        if req.logprobs is not None:
            lp = R.completion_logprobs(res.logprobs, token_text, self.text_offsets(), len(res.text))
        body = R.CompletionResponse(
            id=gen.req_id, created=gen.created, model=self.model_name,
            choices=[R.CompletionChoice(text=res.text, logprobs=lp, finish_reason=res.finish_reason)],
            usage=R.Usage.of(res.num_prompt_tokens, res.num_output_tokens, res.num_cached_tokens))
        return JSONResponse(body.model_dump(mode="json"))

    async def _completion_sse(self, gen: Generation, req: CompletionRequest, token_text) -> AsyncIterator[str]:
        offset, usage, offsets = 0, R.Usage.of(len(gen.prompt_ids), 0), self.text_offsets()
        try:
            async for out in gen.outputs():
                lp = None
                if req.logprobs is not None and out.logprobs:
                    lp = R.completion_logprobs(out.logprobs, token_text, offsets, offset + len(out.new_text))
                usage = R.Usage.of(out.num_prompt_tokens or len(gen.prompt_ids), out.num_output_tokens,
                                   out.num_cached_tokens)
                if out.new_text or lp is not None or out.finished:
                    choice = R.CompletionChoice(text=out.new_text, logprobs=lp,
                                                finish_reason=out.finish_reason if out.finished else None)
                    chunk = R.CompletionResponse(id=gen.req_id, created=gen.created, model=self.model_name,
                                                 choices=[choice])
                    yield sse(chunk.model_dump_json())
                offset += len(out.new_text)
            if req.include_usage:
                chunk = R.CompletionResponse(id=gen.req_id, created=gen.created, model=self.model_name,
                                             choices=[], usage=usage)
                yield sse(chunk.model_dump_json())
        except APIError as exc:
            yield sse(json.dumps(exc.body()))
        yield sse("[DONE]")

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        """/v1/chat/completions (``runtime/server/chat.py``)."""
        return await chat_completions(self, req, request)
