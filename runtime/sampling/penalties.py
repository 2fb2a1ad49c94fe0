"""Repetition, presence and frequency penalties on a step's logits, vectorised over its rows.

Order and formulas as vLLM applies them (before temperature, top-k and top-p):

1. repetition penalty p (CTRL, Keskar et al. 2019; transformers' ``RepetitionPenaltyLogitsProcessor``):
   for every token that occurs in the row's prompt or output so far, ``logit / p`` if the logit is
   positive, ``logit * p`` otherwise;
2. OpenAI's presence / frequency penalties over the *generated* tokens only:
   ``logit[t] -= frequency * count(t) + presence * (count(t) > 0)``.

Counts come from the token history each slot keeps on the last pipeline stage
(``DeviceState.all_token_ids`` with ``prefill_len`` / ``total_len``): one ``scatter_add`` over
``[P, max_model_len]`` per step for all P penalised rows, no token ids shipped per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling.batch import SamplingBatch


@dataclass
class TokenHistory:
    """The token history of the penalised rows, gathered from slot-indexed device state.

    Attributes:
        token_ids: [P, L] int64, row i = ``all_token_ids`` of its slot (prompt, then output;
            entries at or past ``total_len`` are stale and ignored).
        prompt_len: [P] int64 prompt tokens of each row.
        total_len: [P] int64 prompt + generated tokens so far (the token sampled now excluded).
    """
    token_ids: torch.Tensor
    prompt_len: torch.Tensor
    total_len: torch.Tensor

    @classmethod
    def gather(cls, all_token_ids: torch.Tensor, prefill_len: torch.Tensor, total_len: torch.Tensor,
               slots: torch.Tensor) -> "TokenHistory":
        """History of ``slots`` ([P] int64) from the state arrays ``all_token_ids``
        [max_num_reqs, max_model_len], ``prefill_len`` and ``total_len`` [max_num_reqs]."""
        return cls(all_token_ids.index_select(0, slots), prefill_len.index_select(0, slots),
                   total_len.index_select(0, slots))


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, history: TokenHistory) -> torch.Tensor:
    """Penalised copy of ``logits`` [R, V] fp32 (rows without penalties unchanged).

    ``history`` holds the rows ``batch.penalty_rows``, in that order.
    Raises: ValueError if the history does not match the penalised rows.
    """
    r = batch.penalty_rows
    if r is None:
        return logits
    if history.token_ids.shape[0] != r.shape[0]:
        raise ValueError(f"history of {history.token_ids.shape[0]} rows for {r.shape[0]} penalised rows")
    x = logits.index_select(0, r)  # [P, V]
    pos = torch.arange(history.token_ids.shape[1], device=logits.device).unsqueeze(0)
    in_prompt = pos < history.prompt_len.unsqueeze(1)                                  # [P, L]
    in_output = ~in_prompt & (pos < history.total_len.unsqueeze(1))                    # [P, L]
    ids = history.token_ids.clamp(0, x.shape[1] - 1)
    out_count = torch.zeros_like(x).scatter_add_(1, ids, in_output.to(x.dtype))        # [P, V]
    seen = torch.zeros_like(x).scatter_add_(1, ids, in_prompt.to(x.dtype)).add_(out_count) > 0
    rep = batch.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    x = x - batch.frequency.unsqueeze(1) * out_count - batch.presence.unsqueeze(1) * (out_count > 0).to(x.dtype)
    out = logits.clone()
    out[r] = x
    return out
