"""N-gram speculative decoding: the proposer and the acceptance rule (pure; issue #14).

**Proposer** (prompt lookup, Saxena 2023 "Prompt Lookup Decoding"; vLLM's ``NgramProposer``):
take the last ``n`` tokens of the request's history (prompt + generated tokens), find their most
recent earlier occurrence in the history, and propose the (up to ``k``) tokens that followed it.
When nothing matches, or the match is followed by fewer than ``k`` tokens, the remaining drafts are
*padding* (:data:`PAD_DRAFT`, repeats of the last token): a decode row always carries exactly
``1 + k`` query tokens, so the scheduler's budget, the KV blocks and the hidden-state shapes never
depend on the proposal. A padded draft is verified like any other (it is usually rejected; when
it happens to equal the target's token it is a correct token and is kept).

**Where drafts come from.** The proposal is a pure function of the token history, and every rank
that needs drafts holds that history on device after the deferred consume: rank 0 (its input ids
at positions ``start + 1 .. start + k``) and the last rank (to verify). So drafts are never sent:
each of those ranks computes them itself and they agree (same history, same function). The
intermediate ranks only see hidden states and need no drafts.

**Acceptance** (:func:`accept_prefix`): the last rank samples a token at each of the row's
``1 + k`` positions with the ordinary sampler (position ``i`` conditioned on the history plus
drafts ``d_1 .. d_i``), ``t_0 .. t_k``, and keeps the longest prefix whose drafts match:
``j = min{i : t_i != d_{i+1}}`` (or ``k``), emitting ``t_0 .. t_j`` (``num_sampled = j + 1``,
``num_rejected = k - j``). Greedy rows: ``t_i`` is the argmax, so this is "longest matching
prefix plus the bonus token". Rows with temperature: this *is* standard speculative (rejection)
sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling") for a draft
distribution ``q`` that is a point mass on ``d`` (an n-gram proposer is deterministic): the
rule there accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise samples
from ``norm(max(0, p - q))``, i.e. from ``p`` conditioned on ``x != d``. Sampling ``t ~ p`` and
accepting iff ``t == d`` accepts with probability ``p(d)``, and on rejection ``t`` is distributed
as ``p(x) / (1 - p(d))`` for ``x != d`` — the same law. Since the sampler draws a seeded row's
uniform from (seed, output index) only, a seeded request also gets *the same tokens* with and
without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: the largest ``K`` (draft tokens per decode row) the engine accepts (``--spec-tokens``, bounded
#: in :data:`runtime.config.SCHEDULER_BOUNDS`); the simulator refuses more too
MAX_SPEC_TOKENS = 16

#: what fills draft positions the n-gram match does not cover: the history's last token
PAD_DRAFT = "repeat-last"


def propose_ngram(history: Sequence[int] | np.ndarray, n: int, k: int) -> np.ndarray:
    """Prompt-lookup proposal of exactly ``k`` draft tokens.

    Args:
        history: ``[L]`` token ids so far (prompt + generated), L >= 1.
        n: n-gram length to match (>= 1); shorter histories (L <= n) match nothing.
        k: drafts to return (>= 0).

    Returns:
        ``[k]`` int64: the tokens that followed the most recent earlier occurrence of the last
        ``n`` tokens (the occurrence must end before the history's end), then the last history
        token repeated for the positions the match does not cover (no match: all of them).

    Raises:
        ValueError: ``n < 1``, ``k < 0`` or an empty history.
    """
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 and k >= 0, got n={n}, k={k}")
    h = np.asarray(history, dtype=np.int64)
    if h.size == 0:
        raise ValueError("empty history")
    drafts = np.full(k, h[-1], dtype=np.int64)
    if k == 0 or h.size <= n:
        return drafts
    start = _last_match(h, n)
    if start >= 0:
        follow = h[start + n:start + n + k]
        drafts[:follow.size] = follow
    return drafts


def _last_match(h: np.ndarray, n: int) -> int:
    """Start of the most recent occurrence of ``h[-n:]`` that ends before ``len(h)``, or -1."""
    tail = h[-n:]
    windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # [L - n, n]
    hits = np.nonzero((windows == tail).all(axis=1))[0]
    return int(hits[-1]) if hits.size else -1


def accept_prefix(sampled: Sequence[int] | np.ndarray, drafts: Sequence[int] | np.ndarray) -> int:
    """Number of accepted drafts ``j``: the longest prefix with ``sampled[i] == drafts[i]``.

    Args:
        sampled: ``[k + 1]`` the target's token at each position of the row.
        drafts: ``[k]`` the proposal the row carried.

    Returns:
        ``j`` in ``0 .. k``; the row emits ``sampled[:j + 1]`` (num_sampled = j + 1,
        num_rejected = k - j).

    Raises:
        ValueError: ``len(sampled) != len(drafts) + 1``.
    """
    s, d = np.asarray(sampled), np.asarray(drafts)
    if s.shape[0] != d.shape[0] + 1:
        raise ValueError(f"{s.shape[0]} sampled tokens for {d.shape[0]} drafts (need drafts + 1)")
    miss = np.nonzero(s[:-1] != d)[0]
    return int(miss[0]) if miss.size else int(d.shape[0])


def verify_rows(sampled: np.ndarray, drafts: np.ndarray, num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`accept_prefix` over a batch of rows with their own draft counts.

    Args:
        sampled: ``[R, K + 1]`` target tokens (row r uses its first ``num_drafts[r] + 1``).
        drafts: ``[R, K]`` proposals (row r uses its first ``num_drafts[r]``).
        num_drafts: ``[R]`` drafts per row, 0 .. K (0: a plain decode or final prefill chunk).

    Returns:
        ``(num_sampled [R], num_rejected [R])`` int64: ``j + 1`` and ``num_drafts - j``.
    """
    r = sampled.shape[0]
    num_sampled = np.zeros(r, dtype=np.int64)
    num_rejected = np.zeros(r, dtype=np.int64)
    for i in range(r):
        k = int(num_drafts[i])
        j = accept_prefix(sampled[i, :k + 1], drafts[i, :k])
        num_sampled[i], num_rejected[i] = j + 1, k - j
    return num_sampled, num_rejected


def drafts_for_row(room: int, num_spec_tokens: int, budget_tokens: int) -> int:
    """Drafts a decode row gets: ``min(K, room, budget_tokens - 1)``, at least 0.

    Args:
        room: outputs the request may still produce beyond this row's first token (tokens):
            ``max_tokens - optimistic outputs - 1``, so an accepted run never carries the request
            past ``max_tokens`` / ``max_seq_len``.
        num_spec_tokens: ``K`` (``--spec-tokens``).
        budget_tokens: tokens left in the step's budget (the row needs ``1 + drafts``).
    """
    return max(0, min(num_spec_tokens, room, budget_tokens - 1))
