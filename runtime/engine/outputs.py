"""Incremental outputs the engine yields per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token plus the top alternatives (token id -> logprob)."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One increment of a request's stream.

    Attributes:
        req_id: request id.
        new_token_ids: token ids produced since the previous increment.
        new_text: detokenized text for them (never a broken UTF-8 sequence; stop strings cut).
        finished: True on the last increment.
        finish_reason: "stop", "length" or "abort" when finished, else None.
        num_prompt_tokens: prompt length (tokens).
        num_output_tokens: output tokens so far.
        logprobs: one entry per new token when requested.
        error: message when the request failed (itself, or because the engine failed).
        error_kind: ``"request"`` (only this request failed; the engine goes on), ``"engine"``
            (the engine stopped) or ``"shutdown"`` (the server is stopping and ended the request),
            see :mod:`runtime.engine.faults`; None without an error.
    """
    req_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_kind: str | None = None


def logprobs_for(result, row_of: dict[str, int] | None, req_id: str,
                 token_ids: list[int]) -> list[TokenLogprob] | None:
    """The logprob entries of ``req_id``'s new tokens in a step result, if it asked for them.

    Args:
        result: the last rank's ``StepResult``; ``result.logprobs`` holds one ``(logprob,
            {token id: logprob})`` or None per batch row, or, for a row that carried speculative
            drafts (``--spec-tokens``), a list of such pairs, one per emitted token.
        row_of: request id -> batch row of that step (None: the step carries no logprobs).
    """
    if row_of is None or req_id not in row_of or not token_ids:
        return None
    entry = result.logprobs[row_of[req_id]]
    if entry is None:
        return None
    if isinstance(entry[0], (list, tuple)):  # speculative decoding: (logprob, top) per token
        return [TokenLogprob(t, float(lp), {int(k): float(v) for k, v in top.items()})
                for t, (lp, top) in zip(token_ids, entry)]
    lp, top = entry
    return [TokenLogprob(token_ids[0], float(lp), {int(k): float(v) for k, v in top.items()})]
