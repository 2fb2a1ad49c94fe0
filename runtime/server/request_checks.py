"""Value checks of the OpenAI fields added for issue 32 that the schema runs (pydantic validators).

``prompt`` of /v1/completions: a string, a list of token ids, or a batch (a list of strings or of
token-id lists, at most :data:`MAX_PROMPTS`); ``logit_bias``: token-id keys written as decimal
integers, values in [-100, 100], at most 300 entries. What needs the model (ids against the
vocabulary) is checked in the handlers.
"""

from __future__ import annotations

from typing import Any

from runtime.sampling.logit_bias import MAX_BIAS_VALUE, MAX_LOGIT_BIAS

INT64_MAX = 2**63 - 1
#: prompts in one /v1/completions batch at most
MAX_PROMPTS = 256
#: ``n`` / ``best_of`` at most in the schema (handlers also bound them by ``max_num_seqs``)
MAX_N = 256


def check_token_list(v: list, what: str = "token ids") -> list:
    """A non-empty list of int64 token ids (not bools)."""
    if not v:
        raise ValueError(f"{what} must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ValueError(f"{what} must be integers")
    if any(not 0 <= t <= INT64_MAX for t in v):
        raise ValueError("token ids must be >= 0 (and below the vocabulary size)")
    return v


def check_prompt_field(v: Any) -> Any:
    """``prompt``: a non-empty string, a token-id list, or a batch of either (not mixed)."""
    if isinstance(v, str):
        if not v:
            raise ValueError("the prompt must not be empty")
        return v
    if not isinstance(v, list) or not v:
        raise ValueError("must be a non-empty string or a non-empty list of token ids")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return check_token_list(v)
    if all(isinstance(p, str) for p in v) or all(isinstance(p, list) for p in v):
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        for i, p in enumerate(v):
            if isinstance(p, str) and not p:
                raise ValueError(f"prompt {i} of the batch is empty")
            if isinstance(p, list):
                check_token_list(p, f"prompt {i} of the batch")
        return v
    raise ValueError("the prompt must be a string, a list of token ids (integers) or a batch of "
                     "strings or of token-id lists")


def check_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    """``logit_bias``: ``{"token id": bias}``; keys decimal integers, biases in [-100, 100]."""
    if not v:
        return v
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    for key, bias in v.items():
        if not key.isdigit() or str(int(key)) != key or int(key) > INT64_MAX:
            raise ValueError(f"key {key!r} is not a token id (a non-negative decimal integer)")
        if not -MAX_BIAS_VALUE <= bias <= MAX_BIAS_VALUE:
            raise ValueError(f"the bias of token {key} is {bias}; biases must be in [-100, 100]")
    return v


#: template variables a request sets through its own fields, never through chat_template_kwargs
RESERVED_TEMPLATE_VARS = ("messages", "add_generation_prompt", "continue_final_message")


def check_template_kwargs(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """``chat_template_kwargs``: extra template variables, none of :data:`RESERVED_TEMPLATE_VARS`."""
    if not v:
        return v
    for key in v:
        if key in RESERVED_TEMPLATE_VARS:
            raise ValueError(f"{key!r} cannot be set through chat_template_kwargs; use the "
                             "request field of that name")
    return v
