"""Response bodies and stream chunks of the OpenAI-compatible endpoints (pydantic).

Shapes follow OpenAI's API so the official ``openai`` client parses them: ``text_completion`` /
``chat.completion`` objects, ``chat.completion.chunk`` stream chunks with ``delta``, ``usage`` with
token counts, and logprobs in the legacy (completions) or ``content`` list (chat) form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from runtime.outputs import TokenLogprob


class Usage(BaseModel):
    """Token counts of one request (tokens)."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ModelCard(BaseModel):
    """One entry of GET /v1/models; ``max_model_len`` is in tokens (vLLM's extension)."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ppstate"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """Legacy logprobs of /v1/completions; ``text_offset`` counts characters of the output text."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A /v1/completions response, or (with ``usage`` None and partial text) one stream chunk."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    """A chat stream increment; absent fields are left out (``{}`` on the final chunk)."""
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


TokenText = Callable[[int], str]


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, decode: TokenText,
                        text_offset: int) -> CompletionLogprobs:
    """Legacy logprobs for sampled tokens.

    ``token_text`` names tokens (possibly ``token_id:N``), ``decode`` gives their real text, and
    ``text_offset`` is where the first token's text starts in the output (characters).
    """
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(token_text(e.token_id))
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({token_text(t): lp for t, lp in e.top.items()})
        out.text_offset.append(text_offset)
        text_offset += len(decode(e.token_id))
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, top_n: int) -> ChatLogprobs:
    """Chat logprobs: each sampled token with its ``top_n`` most likely alternatives."""
    content = []
    for e in entries:
        tok = token_text(e.token_id)
        top = sorted(e.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            token=tok, logprob=e.logprob, bytes=list(tok.encode("utf-8")),
            top_logprobs=[TopLogprob(token=(t := token_text(i)), logprob=lp, bytes=list(t.encode("utf-8")))
                          for i, lp in top]))
    return ChatLogprobs(content=content)
