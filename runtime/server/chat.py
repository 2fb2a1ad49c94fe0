"""/v1/chat/completions: render the chat template, run ``n`` samples, answer or stream.

``chat_template_kwargs`` become variables of the template (e.g. Qwen3's ``enable_thinking``);
``messages``, ``add_generation_prompt`` and ``continue_final_message`` are the request's own fields
and cannot be set through it. With ``n`` > 1 the samples share the prompt's KV blocks
(:mod:`runtime.server.choices`) and come back as choices ``0 .. n-1``; streamed chunks of different
choices interleave. With a reasoning parser (``--reasoning-parser``) the ``<think>`` part of a reply
is ``reasoning_content`` and the rest ``content`` (:mod:`runtime.server.reasoning`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.server import responses as R
from runtime.server.chat_tools import ToolMode
from runtime.server.choices import Choices, sample_params
from runtime.server.errors import APIError
from runtime.server.generation import Generation, GenerationStreamResponse, sse
from runtime.server.reasoning import ReasoningStream, split_reasoning
from runtime.server.schemas import ChatCompletionRequest

#: the :class:`runtime.server.handlers.OpenAIHandlers` serving the request (not imported: the
#: handlers import this module)
Handlers = Any


async def chat_prompt(h: Handlers, req: ChatCompletionRequest, req_id: str,
                      tools: ToolMode) -> list[int]:
    """The token ids of the rendered conversation (with the request's ``tools`` passed to the
    template as transformers does); 400 naming ``messages[i].field`` for a message missing a
    field its role needs, or ``messages`` when the template fails (no template, roles it
    refuses, a ``chat_template_kwargs`` value it cannot use)."""
    for i, m in enumerate(req.messages):
        missing = m.missing_field()
        if missing is not None:
            raise APIError(f"Missing required parameter: 'messages[{i}].{missing[0]}' "
                           f"({missing[1]}).", param=f"messages[{i}].{missing[0]}",
                           code="missing_required_parameter")
    messages = [m.as_template_dict() for m in req.messages]
    kwargs = {**(req.chat_template_kwargs or {}), **tools.template_kwargs()}
    return await h.tokenize(req_id, "messages", h.engine.tokenizer.encode_chat, messages,
                            add_generation_prompt=req.generation_prompt,
                            continue_final_message=bool(req.continue_final_message), **kwargs)


async def chat_completions(h: Handlers, req: ChatCompletionRequest, request: Request) -> Response:
    """Serve one chat completion request (``n`` choices)."""
    arrival = time.perf_counter()
    h.check_model(req.model)
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    tok = h.engine.tokenizer
    tools = ToolMode(req, getattr(tok, "chat_template", None),
                     getattr(tok, "chat_template_variables", None))
    ids = await chat_prompt(h, req, req_id, tools)
    n = req.n or 1
    if n > h.config.scheduler.max_num_seqs:
        raise APIError(f"Invalid value for 'n': {n} samples exceed what this engine holds at "
                       f"once (--max-num-seqs {h.config.scheduler.max_num_seqs}).", param="n",
                       code="invalid_value")
    limit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limit = h.output_limit(req.output_limit, None, len(ids), "messages", limit_field)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    params = await h.constrain(req, h.sampling_params(req, limit, top_n), tools)
    gens = [Generation(h.engine, h.metrics, req_id if n == 1 else f"{req_id}-{j}", ids,
                       sample_params(params, j), "messages", arrival,
                       fork_of=None if j == 0 else f"{req_id}-0") for j in range(n)]
    choices = Choices(gens, n)
    try:
        choices.start()
    except BaseException:
        await choices.close()
        raise
    view = _ChatView(h, req, req_id, gens[0].created, len(ids), top_n, tools)
    if req.stream:
        return GenerationStreamResponse(view.stream(choices), choices)
    results = await choices.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    out = []
    for k, res in enumerate(results):
        lp = (R.chat_logprobs(res.logprobs, view.token_text, tok.token_bytes, top_n)
              if top_n is not None else None)
        reasoning, content = (None, res.text) if h.reasoning_parser is None else \
            split_reasoning(h.reasoning_parser, res.text)
        message, finish = tools.reply(content or "", res.finish_reason)
        if reasoning is not None:
            message.reasoning_content = reasoning
        if content is None and not message.tool_calls:
            message.content = None
        out.append(R.ChatChoice(index=k, message=message, logprobs=lp, finish_reason=finish))
    body = R.ChatCompletionResponse(
        id=req_id, created=gens[0].created, model=h.model_name, choices=out,
        usage=R.Usage.of(len(ids), sum(r.num_output_tokens for r in results),
                         results[0].num_cached_tokens))
    return JSONResponse(body.model_dump(mode="json"))


class _ChatView:
    """Stream chunks of a chat completion."""

    def __init__(self, h: Handlers, req: ChatCompletionRequest, req_id: str, created: int,
                 prompt_len: int, top_n: int | None, tools: ToolMode) -> None:
        self.h, self.req, self.req_id, self.created = h, req, req_id, created
        self.prompt_len, self.top_n, self.tools = prompt_len, top_n, tools
        self.token_text = h.token_text(bool(req.return_tokens_as_token_ids))

    def chunk(self, index: int, delta: R.Delta, lp=None, finish=None, usage=None,
              choices: bool = True) -> str:
        ch = [R.ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)] \
            if choices else []
        return sse(R.ChatCompletionChunk(id=self.req_id, created=self.created,
                                         model=self.h.model_name, choices=ch,
                                         usage=usage).model_dump_json())

    async def stream(self, choices: Choices) -> AsyncIterator[str]:
        m = len(choices.gens)
        parsers = [None if self.h.reasoning_parser is None else ReasoningStream(self.h.reasoning_parser)
                   for _ in range(m)]
        calls = [self.tools.stream() for _ in range(m)]   # content -> tool_calls deltas
        done, cached = [0] * m, 0
        tok = self.h.engine.tokenizer
        try:
            for k in range(m):
                yield self.chunk(k, R.Delta(role="assistant", content=""))
            async for k, out in choices.interleaved():
                done[k] = out.num_output_tokens
                cached = out.num_cached_tokens if k == 0 and out.num_cached_tokens else cached
                lp = (R.chat_logprobs(out.logprobs, self.token_text, tok.token_bytes, self.top_n)
                      if self.top_n is not None and out.logprobs else None)
                reasoning, content = None, out.new_text
                if parsers[k] is not None:
                    reasoning, content = parsers[k].push(out.new_text)
                    if out.finished:
                        r2, c2 = parsers[k].flush()
                        reasoning = _cat(reasoning, r2)
                        content = _cat(content, c2)
                deltas = calls[k].feed(content) if content else []
                if reasoning:
                    deltas.insert(0, R.Delta(reasoning_content=reasoning))
                if lp is not None and not deltas:
                    deltas = [R.Delta(content="")]
                for i, d in enumerate(deltas):
                    yield self.chunk(k, d, lp if i == 0 else None)
                if out.finished:
                    last, finish = calls[k].finish(out.finish_reason)
                    for d in last:
                        yield self.chunk(k, d)
                    yield self.chunk(k, R.Delta(), finish=finish)
            if self.req.include_usage:
                yield self.chunk(0, R.Delta(), usage=R.Usage.of(self.prompt_len, sum(done), cached),
                                 choices=False)
        except APIError as exc:
            yield sse(json.dumps(exc.body()))
        yield sse("[DONE]")


def _cat(a: str | None, b: str | None) -> str | None:
    return (a or "") + (b or "") or None
