"""Speculative decoding's per-step tensor work, batched over rows on the rank's device (#33).

The rules are :mod:`ppstate.speculative`'s (prompt-lookup proposal, longest matching prefix);
these functions apply them to all rows of a step at once with torch operations, so a step with
drafts has no Python loop over its rows and no host synchronisation (CUDA or CPU tensors alike):

* :func:`propose_ngram_rows` -- the n-gram proposal of every row from the slot-indexed token
  history ``all_token_ids`` (``[R, K]``; equal row by row to :func:`ppstate.speculative.propose_ngram`).
* :func:`draft_scatter` -- the flat ``(row, draft)`` index of the drafts a step uses (numpy).
* :func:`accept_rows` -- the acceptance rule over ``[R, K + 1]`` sampled tokens: ``num_sampled``
  and ``num_rejected`` per row (equal to :func:`ppstate.speculative.verify_rows`).

Cost: the proposal compares every ``n``-token window of each row's history with its tail,
``R x L x n`` element compares (``L`` the longest history of the step), a few kernels whatever
``R``; ``python -m runtime.bench.spec_cost`` measures it per step (``proposer_ms``).
"""

from __future__ import annotations

import numpy as np
import torch


def propose_ngram_rows(all_token_ids: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
                       max_len: int, n: int, k: int) -> torch.Tensor:
    """Prompt-lookup drafts of ``R`` rows at once.

    Args:
        all_token_ids: ``[max_num_reqs, max_model_len]`` int64 token history per slot.
        slots: ``[R]`` int64 slot of each row (device of ``all_token_ids``).
        lengths: ``[R]`` int64 history length of each row (>= 1): tokens ``0 .. length - 1``.
        max_len: an upper bound of ``lengths`` (Python int, e.g. from the host mirror; sets the
            searched width, so no device read is needed).
        n: n-gram length (>= 1); k: drafts per row (>= 0).

    Returns:
        ``[R, k]`` int64: for each row the ``k`` tokens that followed the most recent earlier
        occurrence of its last ``n`` tokens (ending before the history's end), the last history
        token where the match does not cover a position or nothing matches.

    Raises:
        ValueError: ``n < 1`` or ``k < 0``.
    """
    if n < 1 or k < 0:
        raise ValueError(f"need n >= 1 and k >= 0, got n={n}, k={k}")
    r = slots.shape[0]
    dev = all_token_ids.device
    width = max(int(max_len), 1)
    hist = all_token_ids.index_select(0, slots)[:, :width]                      # [R, Lw]
    lengths = lengths.to(torch.int64)
    last = hist.gather(1, (lengths - 1).clamp(0, width - 1)[:, None])           # [R, 1]
    drafts = last.expand(r, k).clone()                                          # [R, k]
    if k == 0 or width <= n:
        return drafts
    tail_idx = (lengths[:, None] - n + torch.arange(n, device=dev)).clamp(0, width - 1)
    tail = hist.gather(1, tail_idx)                                             # [R, n]
    windows = hist.unfold(1, n, 1)                                              # [R, Lw-n+1, n]
    hit = (windows == tail[:, None, :]).all(dim=2)                              # [R, Lw-n+1]
    start = torch.arange(hit.shape[1], device=dev)                              # [Lw-n+1]
    # the occurrence must end before the history's last token: start + n <= length - 1
    hit &= start[None, :] <= (lengths[:, None] - 1 - n)
    best = torch.where(hit, start[None, :], -1).amax(dim=1)                     # [R], -1: none
    follow = best[:, None] + n + torch.arange(k, device=dev)[None, :]           # [R, k]
    ok = (best[:, None] >= 0) & (follow < lengths[:, None])
    got = hist.gather(1, follow.clamp(0, width - 1))
    return torch.where(ok, got, drafts)


def draft_scatter(num_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row [D], j [D])`` int64: every used draft position, ``D = sum(num_drafts)``, in row
    order (row ``i`` contributes ``j = 0 .. num_drafts[i] - 1``)."""
    nd = np.asarray(num_drafts, dtype=np.int64)
    row = np.repeat(np.arange(nd.size, dtype=np.int64), nd)
    j = np.arange(row.size, dtype=np.int64) - np.repeat(np.cumsum(nd) - nd, nd)
    return row, j


def accept_rows(sampled: torch.Tensor, drafts: torch.Tensor,
                num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule of :func:`ppstate.speculative.accept_prefix` over a batch.

    Args:
        sampled: ``[S, K + 1]`` int64 target token at each position (row ``i`` uses
            ``num_drafts[i] + 1``; the rest is ignored).
        drafts: ``[S, K]`` int64 proposals (row ``i`` uses ``num_drafts[i]``).
        num_drafts: ``[S]`` int64 drafts per row, ``0 .. K``.

    Returns:
        ``(num_sampled [S], num_rejected [S])`` int64 on the same device: ``j + 1`` and
        ``num_drafts - j``, ``j`` the longest prefix with ``sampled[:, :j] == drafts[:, :j]``
        (at most ``num_drafts``).
    """
    s, k = drafts.shape
    if k == 0:
        one = torch.ones(s, dtype=torch.int64, device=sampled.device)
        return one, torch.zeros_like(one)
    nd = num_drafts.to(torch.int64)
    pos = torch.arange(k, device=sampled.device)
    miss = (sampled[:, :k] != drafts) | (pos[None, :] >= nd[:, None])              # [S, K]
    # first miss; K when every draft matched (then num_drafts == K)
    j = torch.where(miss, pos[None, :], k).amin(dim=1)                             # [S]
    return j + 1, nd - j
