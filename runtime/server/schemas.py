"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

Strict mode rejects what OpenAI rejects: ``"5"`` for an integer, ``1`` for a boolean, ``5.0`` for
``max_tokens``. Unknown fields are rejected (OpenAI: "Unrecognized request argument supplied").
OpenAI parameters this server does not implement are accepted only at their neutral value
(``suffix: ""``), so a request is never silently served differently from what it asked for. ``null`` means "the default" for every optional field.

Every integer field has a range that fits the engine's 64-bit message encoding and the workers'
int64 tensors (the table in docs/server.md); what cannot be decided here (token ids against the
vocabulary, lengths against ``max_model_len``, ``top_k`` clamping) is checked in ``handlers``.
Strings are checked to be valid UTF-8 (no lone surrogates) for every field before this schema
runs (``app.read_json``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from runtime.server.request_checks import (MAX_N, check_logit_bias, check_prompt_field,
                                            check_template_kwargs)
from runtime.server.structured_schemas import (ResponseFormat, StructuredOutputs, Tool, ToolCall,
                                               ToolChoice)

MAX_STOP_STRINGS = 4
INT64_MAX = 2**63 - 1
#: |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
MAX_OPENAI_PENALTY = 2.0
#: repetition_penalty at most (vLLM only asks > 0; beyond this every seen token is already ~banned)
MAX_REPETITION_PENALTY = 10.0


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with token counts."""
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="forbid", strict=True)

    #: optional, as in vLLM: a request without ``model`` is served by the one served model
    model: str | None = None
    #: >= 1; an upper bound is the context left after the prompt (handlers: 400 above it)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    #: -1 and 0 mean no cut; any value >= the vocabulary size also means no cut (clamped)
    top_k: int | None = Field(default=None, ge=-1)
    #: [0, 2**63 - 1]; -1 means unseeded (the legacy "random" value, as llama.cpp accepts)
    seed: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=64)
    #: samples per prompt (1 .. max_num_seqs; handlers: 400 above what the engine holds)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    logit_bias: dict[str, float] | None = None
    return_tokens_as_token_ids: bool | None = None
    # structured outputs (docs/structured.md); at most one of them per request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if v is None:
            return v
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(not 0 <= i <= INT64_MAX for i in v):
            raise ValueError("token ids must be >= 0 (and below the vocabulary size)")
        return v

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @property
    def stop_list(self) -> list[str]:
        """``stop`` as a list (tokens are not included in the output)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a batch of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    #: 0 scores the prompt only (needs ``echo``): what log-likelihood evaluation sends
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    #: return the prompt before the completion (with ``logprobs``: the prompt tokens' too)
    echo: bool | None = None
    suffix: str | None = None
    #: samples drawn per prompt, ``n`` of them returned (highest cumulative logprob first)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    #: vLLM's: logprobs of the prompt tokens (0 .. 20 alternatives), see also ``echo``
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        return check_prompt_field(v)

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v < n:
            raise ValueError(f"best_of must be >= n (n is {n})")
        if v is not None and v > 1 and info.data.get("stream"):
            raise ValueError("best_of > 1 cannot be streamed (the best choice is known only at the end)")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` element of a message's content list."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. ``developer`` is treated as ``system``. An assistant message may carry
    ``tool_calls`` (then ``content`` may be null); a ``tool`` message answers one call and needs
    its ``tool_call_id``."""
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, dict) for p in v)):
            return v
        raise ValueError("must be a string or a list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _check_tool_call_id(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("role") != "tool":
            raise ValueError("only tool messages carry a tool_call_id")
        return v

    def missing_field(self) -> tuple[str, str] | None:
        """``(field, reason)`` when a field this role needs is absent (checked by the handler,
        which names ``messages[i].<field>`` in its 400), else None."""
        if self.role == "tool" and self.tool_call_id is None:
            return "tool_call_id", "a tool message needs the tool_call_id of the call it answers"
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", ("content is required (it may be null only on an assistant "
                               "message with tool_calls)")
        return None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined; ``tool_calls`` with
        parsed arguments and ``tool_call_id``, as transformers passes them)."""
        c = self.content
        text = c if isinstance(c, str) or c is None else "".join(p.text for p in c)
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            d["tool_calls"] = [t.as_template_dict() for t in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            d["name"] = self.name
        return d


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions. Without max_tokens a reply may fill the context window."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    #: vLLM's extension: append the template's assistant header (default true)
    add_generation_prompt: bool | None = None
    #: vLLM's extension: continue the final (assistant) message instead of opening a new turn
    continue_final_message: bool | None = None
    #: extra variables for the chat template (e.g. Qwen3's ``enable_thinking``)
    chat_template_kwargs: dict[str, Any] | None = None
    #: tool calling (docs/structured.md): function tools, how the model may use them
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _check_continue(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        if not v:
            return v
        if info.data.get("add_generation_prompt") is not False:
            raise ValueError("continue_final_message needs add_generation_prompt set to false "
                             "(they are not compatible, as in vLLM and transformers)")
        messages = info.data.get("messages")
        if messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs a conversation that ends with an "
                             "assistant message")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_template_kwargs(v)

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    @property
    def generation_prompt(self) -> bool:
        """Whether the rendered prompt ends with the template's assistant header."""
        return self.add_generation_prompt is not False

    @property
    def output_limit(self) -> int | None:
        """The requested output length (max_completion_tokens wins over max_tokens), or None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
