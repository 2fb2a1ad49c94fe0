"""The logprobs of one step's sampled tokens (and of the prompt tokens its prefill rows scored,
:class:`PromptLogprobs`) as arrays: the last rank's payload to the engine.

One entry per step row that asked for logprobs (``SamplingParams.logprobs`` not None), in row
order. The worker fills it with one device-to-host copy per array and no per-row Python; it
travels as raw array bytes (:class:`runtime.messages.LogprobArrays`); the engine turns only the
entries of the requests that asked into :class:`~runtime.engine.outputs.TokenLogprob` objects.
Speculative decoding's verify (#14, CPU path) still sends per-row lists (see
:func:`runtime.engine.outputs.logprobs_for`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepLogprobs:
    """Logprob entries of one step.

    Attributes:
        rows: ``[S]`` int32 step row of each entry (ascending).
        logprobs: ``[S]`` float32 log-probability of the row's sampled token.
        ks: ``[S]`` int32 alternatives the row asked for (0 <= ks <= K).
        top_ids: ``[S, K]`` int64 most likely token ids, most likely first (K = max(ks)).
        top_logprobs: ``[S, K]`` float32 their log-probabilities.

    Raises:
        ValueError: arrays of inconsistent shapes, or ``ks`` outside ``[0, K]``.
    """
    rows: np.ndarray
    logprobs: np.ndarray
    ks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def __post_init__(self) -> None:
        s = self.rows.shape[0]
        k = self.top_ids.shape[1] if self.top_ids.ndim == 2 else -1
        if (self.rows.shape != (s,) or self.logprobs.shape != (s,) or self.ks.shape != (s,)
                or self.top_ids.shape != (s, k) or self.top_logprobs.shape != (s, k)
                or (s and (self.ks.min() < 0 or self.ks.max() > k))):
            raise ValueError(f"inconsistent logprob arrays: rows {self.rows.shape}, logprobs "
                             f"{self.logprobs.shape}, ks {self.ks.shape}, top "
                             f"{self.top_ids.shape} / {self.top_logprobs.shape}")

    def entry(self, j: int) -> tuple[float, dict[int, float]]:
        """Entry ``j``: (logprob of the sampled token, {token id: logprob} of its top ks[j])."""
        k = int(self.ks[j])
        return (float(self.logprobs[j]),
                dict(zip(self.top_ids[j, :k].tolist(), self.top_logprobs[j, :k].tolist())))


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt logprob entries of one step, on the host.

    Attributes:
        rows: ``[P]`` int32 step row of each entry (ascending, positions ascending within a row).
        positions: ``[P]`` int32 prompt position of the scored token (>= 1).
        token_ids: ``[P]`` int64 the prompt token at that position.
        logprobs: ``[P]`` float32 its log-probability given the tokens before it.
        ks: ``[P]`` int32 alternatives asked for (0 <= ks <= K).
        top_ids, top_logprobs: ``[P, K]`` int64 / float32 most likely tokens there, most likely first.
    """
    rows: np.ndarray
    positions: np.ndarray
    token_ids: np.ndarray
    logprobs: np.ndarray
    ks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    def entry(self, j: int) -> tuple[int, int, float, dict[int, float]]:
        """Entry ``j``: (position, token id, logprob, {token id: logprob} of its top ks[j])."""
        k = int(self.ks[j])
        return (int(self.positions[j]), int(self.token_ids[j]), float(self.logprobs[j]),
                dict(zip(self.top_ids[j, :k].tolist(), self.top_logprobs[j, :k].tolist())))
