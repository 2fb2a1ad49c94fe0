"""Incremental outputs the engine yields per request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ppstate.step_updates import StepUpdates
from runtime.sampling.step_logprobs import StepLogprobs


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
        scheduled_s: on the increment with the first tokens: ``time.monotonic()`` of the step
            that first scheduled the request (None before, or when never scheduled).
        queue_s: on that increment: seconds from the engine's arrival to ``scheduled_s``.
        num_cached_tokens: prompt tokens the prefix cache supplied at admission (tokens).
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, on the first increment that
            carries tokens: one entry per prompt token, None for the first (it has no context).
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
    scheduled_s: float | None = None
    queue_s: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None


def logprob_index(result, rows: tuple[str, ...]) -> dict[str, int] | None:
    """Request id -> index of its entry in ``result.logprobs``; None when the step carries none.

    For :class:`~runtime.sampling.step_logprobs.StepLogprobs` only the requests that asked for logprobs
    are indexed (O(entries), not O(rows)); for per-row lists (speculative decoding) the index is
    the step row.

    Args:
        result: the last rank's ``StepResult``.
        rows: ``[num_rows]`` request id of each row of that step.
    """
    lps = result.logprobs
    if lps is None:
        return None
    if isinstance(lps, StepLogprobs):
        return {rows[r]: j for j, r in enumerate(lps.rows.tolist())}
    return {r: i for i, r in enumerate(rows)}


def logprobs_for(result, index: dict[str, int] | None, req_id: str,
                 token_ids: list[int]) -> list[TokenLogprob] | None:
    """The logprob entries of ``req_id``'s new tokens in a step result, if it asked for them.

    Args:
        result: the last rank's ``StepResult``; ``result.logprobs`` is a
            :class:`~runtime.sampling.step_logprobs.StepLogprobs`, or (speculative decoding,
            ``--spec-tokens``) one entry per batch row: None, or a list of ``(logprob, {token id:
            logprob})``, one per emitted token.
        index: :func:`logprob_index` of the step (None: the step carries no logprobs).
    """
    if index is None or not token_ids or (j := index.get(req_id)) is None:
        return None
    lps = result.logprobs
    if isinstance(lps, StepLogprobs):
        lp, top = lps.entry(j)
        return [TokenLogprob(token_ids[0], lp, top)]
    entry = lps[j]
    if entry is None:
        return None
    if isinstance(entry[0], (list, tuple)):  # speculative decoding: (logprob, top) per token
        return [TokenLogprob(t, float(lp), {int(k): float(v) for k, v in top.items()})
                for t, (lp, top) in zip(token_ids, entry)]
    lp, top = entry
    return [TokenLogprob(token_ids[0], float(lp), {int(k): float(v) for k, v in top.items()})]


def update_rows(updates) -> Iterable[tuple[str, list[int], str | None]]:
    """``(req_id, token_ids, finish_reason)`` of each update of ``Scheduler.on_step_result``, in
    row order, each ``token_ids`` a fresh list (a stream's increment keeps it).

    A :class:`~ppstate.step_updates.StepUpdates` (one token per row) is read column-wise: no
    ``TokenUpdate`` object per row.
    """
    if isinstance(updates, StepUpdates):
        reasons = [None] * len(updates.req_ids)
        for i, reason in updates.finish_reasons.items():
            reasons[i] = reason
        return zip(updates.req_ids, [[t] for t in updates.token_ids], reasons)
    return [(u.req_id, list(u.token_ids), u.finish_reason) for u in updates]
