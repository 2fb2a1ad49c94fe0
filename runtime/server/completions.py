"""/v1/completions beyond one prompt and one sample: batched prompts, ``n`` / ``best_of``, ``echo``
with prompt logprobs, ``max_tokens: 0`` scoring, and vLLM's ``prompt_logprobs``.

* Batched prompts (a list of strings or of token-id lists): one choice per prompt x ``n``, choice
  ``i * n + j`` being sample ``j`` of prompt ``i`` (OpenAI's indexing); ``usage`` sums the prompts'
  tokens once each and every sample's output tokens.
* ``echo: true`` puts the prompt text before each choice's completion; with ``logprobs: k`` the
  prompt tokens come first in ``logprobs`` (their ``token_logprobs`` from the model, null for the
  first token, as OpenAI and vLLM write it) with ``k`` alternatives each. These are computed on the
  last rank while the prompt is prefilled (:mod:`runtime.sampling.prompt_logprobs`).
* ``max_tokens: 0`` (needs ``echo``) scores the prompt without generating: the engine samples one
  token, which is dropped (``completion_tokens`` 0, ``finish_reason`` ``length``).
* ``best_of`` samples per prompt, the ``n`` with the highest cumulative logprob returned;
  ``completion_tokens`` counts the output tokens of all ``best_of`` samples (what was generated,
  as OpenAI bills it), not only of the ``n`` returned.

Samples of one prompt share its KV blocks (forks, :mod:`runtime.server.choices`) except when the
prompt's logprobs are asked for: every sample then prefills the prompt itself (a position taken
from the cache computes no logits).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from runtime.engine.outputs import TokenLogprob
from runtime.server import responses as R
from runtime.server.choices import Choices, best_choices, sample_params
from runtime.server.errors import APIError
from runtime.server.generation import Collected, Generation, GenerationStreamResponse, sse
from runtime.server.schemas import CompletionRequest

#: the :class:`runtime.server.handlers.OpenAIHandlers` serving the request (not imported: the
#: handlers import this module)
Handlers = Any


def is_plain(req: CompletionRequest) -> bool:
    """Whether the request is one prompt, one sample, no echo: the single-generation path."""
    return (len(req.prompts) == 1 and (req.n or 1) == 1 and (req.best_of or 1) == 1
            and not req.echo and req.prompt_logprobs is None and req.max_tokens != 0)


def check_counts(req: CompletionRequest, max_num_seqs: int) -> tuple[int, int]:
    """``(n, samples per prompt)``; 400 naming ``n`` / ``best_of`` / ``max_tokens`` when they
    cannot be served."""
    n, best_of = req.n or 1, req.best_of or (req.n or 1)
    if best_of > max_num_seqs:
        field = "best_of" if req.best_of else "n"
        raise APIError(f"Invalid value for '{field}': {best_of} samples of one prompt exceed what "
                       f"this engine holds at once (--max-num-seqs {max_num_seqs}).",
                       param=field, code="invalid_value")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("Invalid value for 'max_tokens': 0 scores the prompt only and needs "
                       "'echo': true.", param="max_tokens", code="invalid_value")
    return n, best_of


async def completions(h: Handlers, req: CompletionRequest, request: Request) -> Response:
    """Serve a completion request with any number of prompts and samples (see module doc)."""
    arrival = time.perf_counter()
    n, samples = check_counts(req, h.config.scheduler.max_num_seqs)
    base = f"cmpl-{uuid.uuid4().hex}"
    prompts, texts = [], []
    for i, prompt in enumerate(req.prompts):
        field = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            ids = await h.tokenize(base, field, h.engine.tokenizer.encode, prompt)
            texts.append(prompt)
        else:
            ids = list(prompt)
            h.check_token_ids(ids, field)
            texts.append(None)
        prompts.append(ids)
    score_only = req.max_tokens == 0
    k_prompt = req.logprobs if req.echo and req.logprobs is not None else None
    if req.prompt_logprobs is not None:
        k_prompt = max(k_prompt or 0, req.prompt_logprobs)
    if k_prompt is not None and h.config.scheduler.num_spec_tokens:
        field = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        raise APIError(f"Invalid value for '{field}': prompt logprobs are not computed with "
                       "speculative decoding (--spec-tokens); start the server without it.",
                       param=field, code="invalid_value")
    ranking = samples > n
    gens = []
    for i, ids in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        limit = 1 if score_only else h.output_limit(req.max_tokens, 16, len(ids), field, "max_tokens")
        logprobs = req.logprobs if req.logprobs is not None or not ranking else 0
        params = await h.constrain(req, h.sampling_params(req, limit, logprobs))
        for j in range(samples):
            p = sample_params(params, j)
            fork = None if j == 0 else f"{base}-{i}-0"
            if k_prompt is not None:   # every sample scores the prompt itself (no shared blocks)
                p, fork = p.model_copy(update={"prompt_logprobs": k_prompt}), None
            gens.append(Generation(h.engine, h.metrics, f"{base}-{i}-{j}", ids, p, field, arrival,
                                   fork_of=fork))
    choices = Choices(gens, samples)
    try:
        choices.start()
    except BaseException:
        await choices.close()
        raise
    view = _View(h, req, base, gens[0].created, prompts, texts, samples, score_only)
    if req.stream:
        return GenerationStreamResponse(view.stream(choices), choices)
    results = await choices.collect(request.receive)
    if results is None:
        return Response(status_code=499)
    usage = view.usage(results)   # every generated sample, best_of's discarded ones too
    if ranking:
        results = best_choices(results, len(prompts), samples, n)
        view.samples = n
    return JSONResponse(view.body(results, usage).model_dump(mode="json"))


class _View:
    """Builds the response (or stream chunks) of a multi-generation completion."""

    def __init__(self, h: Handlers, req: CompletionRequest, req_id: str, created: int,
                 prompts: list[list[int]], texts: list[str | None], samples: int,
                 score_only: bool) -> None:
        self.h, self.req, self.req_id, self.created = h, req, req_id, created
        self.prompts, self.texts, self.samples, self.score_only = prompts, texts, samples, score_only
        self.token_text = h.token_text(bool(req.return_tokens_as_token_ids))

    def prompt_text(self, i: int) -> str:
        text = self.texts[i]
        return text if text is not None else self.h.engine.tokenizer.decode(self.prompts[i])

    def echo_logprobs(self, i: int, plps: list[TokenLogprob | None] | None,
                      offsets: R.TextOffsets) -> R.CompletionLogprobs:
        """The prompt part of a choice's logprobs (first token: null logprob and alternatives)."""
        out, ids, end = R.CompletionLogprobs(), self.prompts[i], len(self.prompt_text(i))
        for pos, tid in enumerate(ids):
            e = plps[pos] if plps is not None and pos < len(plps) else None
            out.tokens.append(self.token_text(tid))
            out.token_logprobs.append(None if e is None else e.logprob)
            out.top_logprobs.append(None if e is None else R.top_logprob_keys(e, self.token_text))
            out.text_offset.append(min(offsets.next(tid), end))
        return out

    def choice(self, index: int, res: Collected) -> R.CompletionChoice:
        i = index // self.samples
        req, text, lps = self.req, res.text, res.logprobs
        if self.score_only:
            text, lps = "", []
        lp = None
        offsets = self.h.text_offsets()
        prefix = self.prompt_text(i) if req.echo else ""
        if req.logprobs is not None:
            lp = (self.echo_logprobs(i, res.prompt_logprobs, offsets) if req.echo
                  else R.CompletionLogprobs())
            gen = R.completion_logprobs(lps, self.token_text, offsets, len(prefix) + len(text))
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(lp, name).extend(getattr(gen, name))
        choice = R.CompletionChoice(index=index, text=prefix + text, logprobs=lp,
                                    finish_reason="length" if self.score_only else res.finish_reason)
        if req.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_field(self.prompts[i], res.prompt_logprobs,
                                                           self.token_text)
        return choice

    def usage(self, results: list[Collected]) -> R.Usage:
        firsts = results[::self.samples]
        completion = 0 if self.score_only else sum(r.num_output_tokens for r in results)
        return R.Usage.of(sum(len(p) for p in self.prompts), completion,
                          sum(r.num_cached_tokens for r in firsts))

    def body(self, results: list[Collected], usage: R.Usage) -> R.CompletionResponse:
        """The response of the returned ``results``; ``usage`` counts every generated sample."""
        return R.CompletionResponse(id=self.req_id, created=self.created, model=self.h.model_name,
                                    choices=[self.choice(k, r) for k, r in enumerate(results)],
                                    usage=usage)

    async def stream(self, choices: Choices) -> AsyncIterator[str]:
        """SSE chunks, each carrying one choice's increment (choices interleaved by index);
        with ``echo`` a choice's first chunk starts with the prompt."""
        gathered = [Collected() for _ in choices.gens]
        started = [False] * len(choices.gens)
        offsets = [self.h.text_offsets() for _ in choices.gens]
        sent = [0] * len(choices.gens)
        try:
            async for k, out in choices.interleaved():
                res = gathered[k]
                res.num_output_tokens = out.num_output_tokens
                res.num_cached_tokens = out.num_cached_tokens or res.num_cached_tokens
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if self.score_only and not out.finished:
                    continue
                text = "" if self.score_only else out.new_text
                lps = [] if self.score_only else (out.logprobs or [])
                i, prefix, lp = k // self.samples, "", None
                if not started[k]:
                    started[k] = True
                    prefix = self.prompt_text(i) if self.req.echo else ""
                    if self.req.echo and self.req.logprobs is not None:
                        lp = self.echo_logprobs(i, res.prompt_logprobs, offsets[k])
                sent[k] += len(prefix) + len(text)
                if self.req.logprobs is not None and lps:
                    gen = R.completion_logprobs(lps, self.token_text, offsets[k], sent[k])
                    lp = gen if lp is None else _extend(lp, gen)
                if prefix or text or lp is not None or out.finished:
                    reason = ("length" if self.score_only else out.finish_reason) if out.finished else None
                    choice = R.CompletionChoice(index=k, text=prefix + text, logprobs=lp,
                                                finish_reason=reason)
                    yield sse(R.CompletionResponse(id=self.req_id, created=self.created,
                                                   model=self.h.model_name,
                                                   choices=[choice]).model_dump_json())
            if self.req.include_usage:
                chunk = R.CompletionResponse(id=self.req_id, created=self.created,
                                             model=self.h.model_name, choices=[],
                                             usage=self.usage(gathered))
                yield sse(chunk.model_dump_json())
        except APIError as exc:
            yield sse(json.dumps(exc.body()))
        yield sse("[DONE]")


def _extend(lp: R.CompletionLogprobs, more: R.CompletionLogprobs) -> R.CompletionLogprobs:
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        getattr(lp, name).extend(getattr(more, name))
    return lp


def prompt_logprobs_field(ids: list[int], plps: list[TokenLogprob | None] | None,
                          token_text) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt position None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token and its alternatives."""
    out: list[dict[str, dict] | None] = []
    for pos, tid in enumerate(ids):
        e = plps[pos] if plps is not None and pos < len(plps) else None
        if e is None:
            out.append(None)
            continue
        items = {e.token_id: e.logprob, **e.top}
        ranked = sorted(e.top, key=lambda t: -e.top[t])
        entry = {}
        for t, v in items.items():
            rank = ranked.index(t) + 1 if t in ranked else 1 + sum(1 for x in e.top.values() if x > v)
            entry[str(t)] = {"logprob": v, "rank": rank, "decoded_token": token_text(t)}
        out.append(entry)
    return out
