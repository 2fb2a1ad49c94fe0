"""Speculative decoding on the ranks: drafts, corrected positions and the last rank's verify (#14).

The rule itself (n-gram proposal, longest matching prefix, why sampling then matching is
rejection sampling for an n-gram draft) is :mod:`ppstate.speculative`; this module applies it to
a step's rows over device state:

* :func:`plan_rows` (every rank, before the forward, after the deferred consume): each row's
  start position from this rank's own counters, which already hold every ``-num_rejected``
  correction it consumed (the scheduler's ``start_positions`` may still be optimistic: it
  scheduled the row before the previous row's rejections reached it), and for decode rows the
  ``k = num_scheduled_tokens - 1`` drafts, computed from the slot's token history (rank 0 and the
  last rank only; the others need no token ids). A decode row is one whose slot finished its
  prefill before this step (mirror ``num_computed_prefill_tokens == prefill_len``), a fact every
  rank derives from the same replicated outputs, so all ranks agree.
* :func:`write_drafts` (rank 0, last rank): drafts into ``all_token_ids[slot, start + 1 ..]`` so
  rank 0 gathers them as input ids and the penalties of the last rank see them as history.
* :func:`logit_index` (last rank): which tokens' logits the stage computes: all ``1 + k`` of a
  decode row, the last one of any other row.
* :func:`verify` (last rank): sample every position as its own row (output index ``base + j``,
  history through draft ``j``), then keep the longest prefix whose drafts match.

Without drafts (``--spec-tokens 0``) none of this runs and the runner behaves as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ppstate.speculative import propose_ngram, verify_rows
from runtime.sampling.penalties import TokenHistory
from runtime.sampling.sampler import sample


@dataclass
class SpecRows:
    """Per-row speculative layout of one step (``R`` rows, ``K`` = spec tokens).

    Attributes:
        starts: ``[R]`` int64 position of each row's first token from this rank's counters.
        num_drafts: ``[R]`` int64 drafts per row (0 except on decode rows).
        drafts: ``[R, K]`` int64 proposals (zeros where not computed / not used).
    """
    starts: np.ndarray
    num_drafts: np.ndarray
    drafts: np.ndarray

    @property
    def any_drafts(self) -> bool:
        return bool(self.num_drafts.any())


def plan_rows(out, state, num_spec_tokens: int, ngram: int, with_drafts: bool) -> SpecRows:
    """The step's :class:`SpecRows`, read before the immediate post-update.

    Args:
        out: the step's SchedulerOutput.
        state: the rank's :class:`~runtime.worker.device_state.DeviceState` (mirror consulted).
        num_spec_tokens: ``K``.
        ngram: n-gram length of the proposer.
        with_drafts: compute the proposals (rank 0 and the last rank).

    Raises:
        ValueError: a decode row asks for more than ``K`` drafts (scheduler / runner disagree).
    """
    m = state.mirror
    slots = out.slots.astype(np.int64)
    starts = m.num_computed_tokens_np[slots].copy()
    decode = m.num_computed_prefill_tokens_np[slots] >= m.prefill_len_np[slots]
    num_drafts = np.where(decode, out.num_scheduled_tokens.astype(np.int64) - 1, 0)
    if int(num_drafts.max(initial=0)) > num_spec_tokens:
        raise ValueError(f"step {out.step}: a decode row carries {int(num_drafts.max())} drafts, "
                         f"--spec-tokens is {num_spec_tokens}")
    drafts = np.zeros((out.num_rows, num_spec_tokens), dtype=np.int64)
    if with_drafts:
        for i in np.nonzero(num_drafts)[0]:
            history = state.all_token_ids[int(slots[i]), :int(starts[i]) + 1].cpu().numpy()
            drafts[i, :num_drafts[i]] = propose_ngram(history, ngram, int(num_drafts[i]))
    return SpecRows(starts, num_drafts, drafts)


def write_drafts(state, out, rows: SpecRows) -> None:
    """``all_token_ids[slot, start + 1 + j] = drafts[i, j]`` for every decode row ``i`` (device).
    The sampled post-update later overwrites them from ``start + 1`` with the accepted tokens."""
    for i in np.nonzero(rows.num_drafts)[0]:
        s, st, k = int(out.slots[i]), int(rows.starts[i]), int(rows.num_drafts[i])
        state.all_token_ids[s, st + 1:st + 1 + k] = torch.as_tensor(rows.drafts[i, :k],
                                                                    device=state.device)
        if getattr(state, "tokens", None) is not None:   # the mirror checks' host copy
            state.tokens.write(s, st + 1, rows.drafts[i, :k])


def logit_index(num_scheduled_tokens: np.ndarray, rows: SpecRows) -> tuple[np.ndarray, np.ndarray]:
    """Tokens whose logits the last stage computes.

    Returns:
        ``(index [N], first [R])`` int64: ``index`` into the step's ``T`` tokens (a decode row's
        ``1 + k`` tokens, the last token of every other row, in row order), and ``first[i]`` the
        position in ``index`` of row ``i``'s first logit row.
    """
    q = num_scheduled_tokens.astype(np.int64)
    ends = np.cumsum(q)
    per_row = rows.num_drafts + 1
    first = np.cumsum(per_row) - per_row
    index = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, per_row)])
    return index.astype(np.int64), first.astype(np.int64)


@dataclass
class Verified:
    """The verify of the sampled rows (``S`` of them).

    Attributes:
        token_ids: ``[S, K + 1]`` int64 emitted ids (first ``num_sampled`` of a row valid).
        num_sampled, num_rejected: ``[S]`` int64.
        sample_out: the sampler's output over the virtual rows (logprobs), or None.
        virtual_first: ``[S]`` index of each row's first virtual row in ``sample_out``.
    """
    token_ids: np.ndarray
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    sample_out: object
    virtual_first: np.ndarray


def verify(logits: torch.Tensor, first: np.ndarray, rows_idx: np.ndarray, out, rows: SpecRows,
           positions_after: np.ndarray, state, num_spec_tokens: int) -> Verified:
    """Sample each position of the sampled rows and accept the longest matching draft prefix.

    Args:
        logits: ``[N, V]`` fp32, row layout of :func:`logit_index`.
        first: ``[R]`` from :func:`logit_index`.
        rows_idx: ``[S]`` the step rows that sample (the need-sampled mask's rows).
        out: the SchedulerOutput; rows: the step's :class:`SpecRows`.
        positions_after: ``[S]`` position of each row's first sampled token (its tokens once the
            row's non-draft tokens are computed); virtual row ``j`` samples at ``+ j``.
        state: the last rank's DeviceState (slot-indexed sampling parameters, token history for
            penalties, drafts written).
        num_spec_tokens: ``K``.
    """
    dev = logits.device
    k = rows.num_drafts[rows_idx]                                   # [S]
    n_virtual = k + 1
    vfirst = np.cumsum(n_virtual) - n_virtual                       # [S]
    src = np.concatenate([first[r] + np.arange(n) for r, n in zip(rows_idx, n_virtual)])
    v_slots = np.repeat(out.slots[rows_idx].astype(np.int64), n_virtual)          # [sum n]
    v_pos = np.concatenate([b + np.arange(n) for b, n in zip(positions_after, n_virtual)])
    batch, _ = state.sampling_state.batch(v_slots, v_pos)
    history = None
    if batch.penalty_rows is not None:  # history through draft j for virtual row j
        v_total = np.concatenate([rows.starts[r] + 1 + np.arange(n) for r, n in zip(rows_idx, n_virtual)])
        pr = batch.penalty_rows
        s_t = torch.as_tensor(v_slots, device=dev)[pr]
        history = TokenHistory(state.all_token_ids.index_select(0, s_t),
                               state.prefill_len.index_select(0, s_t),
                               torch.as_tensor(v_total, device=dev)[pr])
    so = sample(logits.index_select(0, torch.as_tensor(src, device=dev)).float(), batch, history)
    flat = so.token_ids.cpu().numpy().astype(np.int64)
    width = num_spec_tokens + 1
    sampled = np.zeros((len(rows_idx), width), dtype=np.int64)
    for i, (f, n) in enumerate(zip(vfirst, n_virtual)):
        sampled[i, :n] = flat[f:f + n]
    num_sampled, num_rejected = verify_rows(sampled, rows.drafts[rows_idx], k)
    return Verified(sampled, num_sampled, num_rejected, so, vfirst)


class SpecDecoder:
    """The runner's speculative-decoding hooks for one rank (``K`` drafts, ``ngram``).

    Used by :class:`~runtime.worker.runner.StageRunner` when ``--spec-tokens`` > 0: before the
    forward :meth:`prepare` (positions, drafts, which logits), on the last rank :meth:`sample`
    in place of the plain sampler. Every rank runs the same code on the same replicated inputs.
    """

    def __init__(self, num_spec_tokens: int, ngram: int, is_first: bool, is_last: bool) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        self.k, self.ngram = num_spec_tokens, ngram
        self.is_first, self.is_last = is_first, is_last
        self.rows: SpecRows | None = None      # the step being run
        self.first: np.ndarray | None = None   # [R] first logit row of each step row (last rank)

    def prepare(self, out, state) -> np.ndarray:
        """Plan the step's rows and write the drafts; returns ``[R]`` corrected start positions
        (use them, not ``out.start_positions``, for the step's metadata)."""
        self.rows = plan_rows(out, state, self.k, self.ngram, self.is_first or self.is_last)
        if self.is_first or self.is_last:
            write_drafts(state, out, self.rows)
        return self.rows.starts

    def logit_meta(self, meta, out):
        """Last rank: ``meta`` with ``last_token`` covering every decode row's ``1 + k`` tokens."""
        import dataclasses
        index, self.first = logit_index(out.num_scheduled_tokens, self.rows)
        return dataclasses.replace(meta, last_token=torch.as_tensor(index, device=meta.slots.device))

    def sample(self, out, mask: np.ndarray, logits: torch.Tensor, state,
               payload: torch.Tensor) -> tuple[Verified, np.ndarray]:
        """Verify the sampled rows into ``payload`` (``[R, K + 3]`` int64: ids, num_sampled,
        num_rejected). Returns the verify and the ``[S]`` sampled step rows."""
        rows_idx = np.nonzero(mask)[0]
        pos = self.rows.starts[rows_idx] + out.num_scheduled_tokens[rows_idx] \
            - self.rows.num_drafts[rows_idx]
        v = verify(logits, self.first, rows_idx, out, self.rows, pos, state, self.k)
        w = self.k + 1
        r = torch.as_tensor(rows_idx, dtype=torch.int64, device=payload.device)
        payload[r, :w] = torch.as_tensor(v.token_ids, device=payload.device)
        payload[r, w] = torch.as_tensor(v.num_sampled, device=payload.device)
        payload[r, w + 1] = torch.as_tensor(v.num_rejected, device=payload.device)
        return v, rows_idx


def logprob_rows(v: Verified, rows_idx: np.ndarray, num_rows: int, ks: np.ndarray):
    """Per step row, the logprob payload of its emitted tokens: a list of ``(logprob, {id:
    logprob})`` (one per emitted token), or None for rows that asked for none. ``ks``: ``[S]``
    alternatives each sampled row asked for, -1 = no logprobs."""
    so = v.sample_out
    if so.logprobs is None or not (ks >= 0).any():
        return None
    lp = so.logprobs.float().cpu().tolist()
    top = None
    if so.top_logprobs is not None:
        top = (so.top_logprobs[0].cpu().tolist(), so.top_logprobs[1].float().cpu().tolist())
    outs: list = [None] * num_rows
    for j, i in enumerate(rows_idx):
        k = int(ks[j])
        if k < 0:
            continue
        f = int(v.virtual_first[j])
        outs[int(i)] = [(lp[f + t], {} if top is None else dict(zip(top[0][f + t][:k], top[1][f + t][:k])))
                        for t in range(int(v.num_sampled[j]))]
    return outs
