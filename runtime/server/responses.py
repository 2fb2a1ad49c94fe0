"""Response bodies and stream chunks of the OpenAI-compatible endpoints (pydantic).

Shapes follow OpenAI's API so the official ``openai`` client parses them: ``text_completion`` /
``chat.completion`` objects, ``chat.completion.chunk`` stream chunks with ``delta``, ``usage`` with
token counts, and logprobs in the legacy (completions) or ``content`` list (chat) form.
"""

from __future__ import annotations

import codecs

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from runtime.engine.outputs import TokenLogprob


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens`` came from the prefix cache (tokens)."""
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts of one request (tokens)."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "Usage":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


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
    """Legacy logprobs of /v1/completions; ``text_offset`` counts characters of the output text.
    With ``echo`` the prompt tokens come first, the first one's logprob and alternatives null."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice; ``prompt_logprobs`` (vLLM's) only when the request asked for them."""
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = Field(default=None, exclude_if=lambda v: v is None)


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
    """The reply; ``reasoning_content`` (the model's ``<think>`` part) only with a reasoning
    parser (``--reasoning-parser``); ``tool_calls`` only when the model called tools
    (docs/structured.md), and then ``content`` may be null."""
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _drop_absent(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


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
    reasoning_content: str | None = None
    #: OpenAI's ``tool_calls`` deltas: ``{"index", "id", "type", "function": {"name", "arguments"}}``
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content),
                                  ("reasoning_content", self.reasoning_content),
                                  ("tool_calls", self.tool_calls)) if v is not None}


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
TokenBytes = Callable[[int], bytes]


class TextOffsets:
    """Where each output token starts in the returned text (characters), across stream chunks.

    Tokens are fed in order; a token's offset is the number of characters its predecessors have
    completed, decoded incrementally from their raw bytes, so a token that starts inside a
    multi-byte character (a byte-level piece of an emoji) points at that character. Special tokens
    (not part of the text) add nothing. Callers clamp offsets to the text actually returned (a stop
    string cuts it).

    Args:
        token_bytes: token id -> its raw bytes (``Tokenizer.token_bytes``).
        is_special: token id -> whether the text leaves it out.
    """

    def __init__(self, token_bytes: TokenBytes, is_special: Callable[[int], bool]) -> None:
        self._bytes, self._special = token_bytes, is_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, token_id: int) -> int:
        """Offset of ``token_id`` (the next output token), in characters."""
        at = self.chars
        if not self._special(token_id):
            self.chars += len(self._decoder.decode(self._bytes(token_id), final=False))
        return at


def top_logprob_keys(entry: TokenLogprob, token_text: TokenText) -> dict[str, float]:
    """One legacy ``top_logprobs`` position: the sampled token and every alternative, most likely
    first, keyed by their text.

    Keys that would collide (two tokens with the same text, e.g. pieces of different emoji that
    both show as U+FFFD) stay distinct: the sampled token keeps its text key, and every later
    token whose text is taken is keyed ``token_id:N``, the spelling vLLM uses for token keys
    (``return_tokens_as_token_ids``). So a position holds ``logprobs`` entries, plus the sampled
    token when it is not among them, and the sampled token's value equals its ``token_logprobs``.
    """
    items = {entry.token_id: entry.logprob}
    for tid, lp in entry.top.items():
        items.setdefault(tid, lp)
    keys: dict[int, str] = {}
    taken: set[str] = set()
    for tid in [entry.token_id, *sorted(entry.top, key=lambda t: -entry.top[t])]:
        if tid in keys:
            continue
        key = token_text(tid)
        if key in taken:
            key = f"token_id:{tid}"
        keys[tid] = key
        taken.add(key)
    return {keys[tid]: items[tid] for tid in sorted(items, key=lambda t: -items[t])}


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, offsets: TextOffsets,
                        text_end: int) -> CompletionLogprobs:
    """Legacy logprobs for sampled tokens.

    ``token_text`` names tokens (their text, or ``token_id:N``); ``offsets`` tracks where each
    token starts in the output text; ``text_end`` is the length of the text returned so far
    (this chunk included), to which offsets are clamped.
    """
    out = CompletionLogprobs()
    for e in entries:
        out.tokens.append(token_text(e.token_id))
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append(top_logprob_keys(e, token_text))
        out.text_offset.append(min(offsets.next(e.token_id), text_end))
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, token_bytes: TokenBytes,
                  top_n: int) -> ChatLogprobs:
    """Chat logprobs: each sampled token with its ``top_n`` most likely alternatives.

    ``bytes`` is the token's own raw bytes (partial UTF-8 for a piece of a multi-byte character),
    so the bytes of the content tokens concatenate to the content's UTF-8; ``token`` is its text
    (U+FFFD for such a piece) or ``token_id:N``.
    """
    content = []
    for e in entries:
        top = sorted(e.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            token=token_text(e.token_id), logprob=e.logprob, bytes=list(token_bytes(e.token_id)),
            top_logprobs=[TopLogprob(token=token_text(i), logprob=lp, bytes=list(token_bytes(i)))
                          for i, lp in top]))
    return ChatLogprobs(content=content)
