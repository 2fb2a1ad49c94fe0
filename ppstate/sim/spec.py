"""Speculative decoding in the simulator (issue #33): a seeded draft proposer and the last rank's
verify, over the reference token model (:func:`ppstate.oracle.model.model_token`).

**Proposer.** The runtime's n-gram proposer finds drafts in the request's history; over the
simulator's random token ids it would find nothing. The simulated proposer is a "draft model"
with a configurable acceptance instead: draft ``i`` (1-based) of a row whose first output index
is ``index`` is the reference model's next token (after the previous draft) with probability
``acceptance`` and a different token otherwise, decided by a hash of (request seed, ``index + i``)
only. So, like the n-gram proposer, it is a pure function of the slot's history: rank 0 (which
feeds the drafts as input ids) and the last rank (which verifies them) each compute the drafts
from their own history, nothing is sent, and they agree unless their histories differ.

**Verify** (:func:`verify`): the last rank samples position ``i`` of a row from the model
conditioned on the row's input token there (rank 0's input, carried to the last rank with the
"hidden states": the last sampled token, then the drafts), and keeps the longest prefix whose
drafts match plus the bonus token (:func:`ppstate.speculative.verify_rows`, the rule the runtime
uses). The payload is ``[rows, K + 3]`` (``width = K + 1``), as the runtime's.
"""

from __future__ import annotations

import numpy as np

from ppstate.oracle.model import FIRST_TOKEN, VOCAB, model_token
from ppstate.payload import SampledPayload
from ppstate.speculative import verify_rows

_SPAN = VOCAB - FIRST_TOKEN


def _unit(sample_seed: int, index: int) -> tuple[float, int]:
    """A uniform in [0, 1) and a 32-bit hash of (``sample_seed``, output ``index``)."""
    h = (sample_seed * 0x27D4EB2F + index * 0x165667B1 + 0x9E3779B9) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0x85EBCA77) & 0xFFFFFFFF
    h ^= h >> 16
    return h / 2**32, h


def propose(sample_seed: int, index: int, prev_token: int, k: int, acceptance: float,
            eos_at: int) -> list[int]:
    """The ``k`` drafts of a decode row.

    Args:
        sample_seed: the request's token-model seed.
        index: output index of the row's first sampled token (outputs the slot already has).
        prev_token: the row's input token (the slot's last output, or last prompt token).
        k: drafts (>= 0).
        acceptance: probability (in [0, 1]) that a draft is the model's token, given the earlier
            drafts of the row were.
        eos_at: output index where the model emits EOS (-1: never).

    Returns:
        ``[k]`` draft token ids.
    """
    drafts, prev = [], prev_token
    for i in range(1, k + 1):
        true = model_token(sample_seed, index + i - 1, prev, eos_at)
        u, h = _unit(sample_seed, index + i)
        if u >= acceptance:   # a wrong draft: any id but the model's
            true = FIRST_TOKEN + (true - FIRST_TOKEN + 1 + h % (_SPAN - 1)) % _SPAN
        drafts.append(true)
        prev = true
    return drafts


def verify(inputs: np.ndarray, num_drafts: np.ndarray, own_drafts: np.ndarray,
           seeds: np.ndarray, index: np.ndarray, eos_at: np.ndarray, sampled_rows: np.ndarray,
           width: int) -> SampledPayload:
    """The last rank's sample of a step with speculation.

    Args:
        inputs: ``[R, width]`` rank 0's input ids per row and position (-1 past the row's).
        num_drafts: ``[R]`` drafts per row (0 except on decode rows).
        own_drafts: ``[R, width - 1]`` the drafts the last rank computed itself.
        seeds, index, eos_at: ``[R]`` token-model seed, first output index and EOS index.
        sampled_rows: ``[S]`` the rows that need a sample.
        width: ``K + 1``.

    Returns:
        A ``[R, width + 2]`` payload: ``token_ids[i, :num_sampled[i]]`` emitted, ``num_rejected``
        the row's rejected drafts.
    """
    r = inputs.shape[0]
    sampled = np.zeros((r, width), dtype=np.int64)
    for i in sampled_rows.tolist():
        for j in range(int(num_drafts[i]) + 1):
            sampled[i, j] = model_token(int(seeds[i]), int(index[i]) + j, int(inputs[i, j]),
                                        int(eos_at[i]))
    num_sampled, num_rejected = verify_rows(sampled, own_drafts, num_drafts)
    payload = SampledPayload.zeros(r, width)
    rows = np.zeros(r, dtype=bool)
    rows[sampled_rows] = True
    payload.token_ids[:] = np.where(np.arange(width) < num_sampled[:, None], sampled, 0)
    payload.num_sampled[:] = np.where(rows, num_sampled, 0)
    payload.num_rejected[:] = np.where(rows, num_rejected, 0)
    return payload
