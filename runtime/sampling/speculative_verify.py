"""Speculative decoding on the ranks: drafts, corrected positions and the last rank's verify (#14).

The rule itself (n-gram proposal, longest matching prefix, why sampling then matching is
rejection sampling for an n-gram draft) is :mod:`ppstate.speculative`; this module applies it to
a step's rows over device state:

* :func:`plan_rows` (every rank, before the forward, after the deferred consume): each row's
  start position from this rank's own counters, which already hold every ``-num_rejected``
  correction it consumed (the scheduler's ``start_positions`` may still be optimistic: it
  scheduled the row before the previous row's rejections reached it), and for decode rows the
  ``k = num_scheduled_tokens - 1`` drafts, computed from the slots' token history on the device,
  all rows in one batched proposal (:mod:`runtime.sampling.speculative_device`; rank 0 and the last rank
  only; the others need no token ids). A decode row is one whose slot finished its
  prefill before this step (mirror ``num_computed_prefill_tokens == prefill_len``), a fact every
  rank derives from the same replicated outputs, so all ranks agree.
* :func:`write_drafts` (rank 0, last rank): drafts into ``all_token_ids[slot, start + 1 ..]`` so
  rank 0 gathers them as input ids and the penalties of the last rank see them as history.
* :func:`logit_index` (last rank): which tokens' logits the stage computes: all ``1 + k`` of a
  decode row, the last one of any other row.
* :func:`verify` (last rank): sample every position as its own row (output index ``base + j``,
  history through draft ``j``), then keep the longest prefix whose drafts match; one sampler
  call and one batched acceptance on the device (issue #33: the CUDA fast path runs the same
  code; no loop over rows, no host sync).

Without drafts (``--spec-tokens 0``) none of this runs and the runner behaves as before; a step
in which no row carries drafts samples on the runner's plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.host_copy import to_device
from runtime.sampling.penalties import TokenHistory
from runtime.sampling.sampler import sample
from runtime.sampling.speculative_device import accept_rows, draft_scatter, propose_ngram_rows


@dataclass
class SpecRows:
    """Per-row speculative layout of one step (``R`` rows, ``K`` = spec tokens).

    Attributes:
        starts: ``[R]`` int64 position of each row's first token from this rank's counters.
        num_drafts: ``[R]`` int64 drafts per row (0 except on decode rows).
        drafts: ``[R, K]`` int64 proposals on the rank's device (zeros where not computed /
            not used).
        decode: ``[R]`` bool, the rows whose slot finished its prefill before this step (None
            in a step of one-token rows only: no row has drafts, nothing reads it).
        any_drafts: whether any row carries drafts (set from ``num_drafts`` when not given).
    """
    starts: np.ndarray
    num_drafts: np.ndarray
    drafts: torch.Tensor
    decode: np.ndarray | None = None
    any_drafts: bool | None = None

    def __post_init__(self) -> None:
        if self.any_drafts is None:
            self.any_drafts = bool(self.num_drafts.any())


def plan_rows(out, state, num_spec_tokens: int, ngram: int, with_drafts: bool,
              zeros: torch.Tensor | None = None) -> SpecRows:
    """The step's :class:`SpecRows`, read before the immediate post-update. The drafts of all
    rows come from one batched proposal over the device's token history
    (:func:`~runtime.sampling.speculative_device.propose_ngram_rows`): no loop over rows, no host sync.

    Args:
        out: the step's SchedulerOutput.
        state: the rank's :class:`~runtime.worker.device_state.DeviceState` (mirror consulted).
        num_spec_tokens: ``K``.
        ngram: n-gram length of the proposer.
        with_drafts: compute the proposals (rank 0 and the last rank).
        zeros: ``[>= R, K]`` int64 zeros on the state's device (never written) whose first ``R``
            rows stand for the drafts of a step without any (no allocation, no kernel per
            step: #33), or None.

    Raises:
        ValueError: a decode row asks for more than ``K`` drafts (scheduler / runner disagree).
    """
    m = state.mirror
    slots = out.slots.astype(np.int64)
    starts = m.num_computed_tokens_np[slots]                      # fancy index: a copy
    q = out.num_scheduled_tokens
    if not q.size or int(q.max()) <= 1:   # one-token rows only (a draft-free step, #33)
        return SpecRows(starts, np.zeros(q.size, dtype=np.int64),
                        _zero_drafts(zeros, out.num_rows, num_spec_tokens, state), None, False)
    decode = m.num_computed_prefill_tokens_np[slots] >= m.prefill_len_np[slots]
    num_drafts = np.where(decode, out.num_scheduled_tokens.astype(np.int64) - 1, 0)
    if int(num_drafts.max(initial=0)) > num_spec_tokens:
        raise ValueError(f"step {out.step}: a decode row carries {int(num_drafts.max())} drafts, "
                         f"--spec-tokens is {num_spec_tokens}")
    dev = state.all_token_ids.device
    if with_drafts and num_drafts.any():
        packed = to_device(np.concatenate([slots, starts + 1]), dev, torch.int64)  # [2R]
        r = slots.size
        drafts = propose_ngram_rows(state.all_token_ids, packed[:r], packed[r:],
                                    int(starts.max()) + 1, ngram, num_spec_tokens)
    else:
        drafts = _zero_drafts(zeros, out.num_rows, num_spec_tokens, state)
    return SpecRows(starts, num_drafts, drafts, decode)


def _zero_drafts(zeros: torch.Tensor | None, num_rows: int, num_spec_tokens: int,
                 state) -> torch.Tensor:
    """``[num_rows, K]`` int64 zeros on the state's device: rows of ``zeros`` when it has
    enough of them there (no allocation), else a new tensor."""
    dev = state.all_token_ids.device
    if zeros is not None and zeros.shape[0] >= num_rows and zeros.device == dev:
        return zeros[:num_rows]
    return torch.zeros(num_rows, num_spec_tokens, dtype=torch.int64, device=dev)


def write_drafts(state, out, rows: SpecRows) -> None:
    """``all_token_ids[slot, start + 1 + j] = drafts[i, j]`` for every draft of every decode row
    ``i`` (one scatter on the device). The sampled post-update later overwrites them from
    ``start + 1`` with the accepted tokens. Nothing at all in a step without drafts."""
    if not rows.any_drafts:
        return
    row, j = draft_scatter(rows.num_drafts)
    if not row.size:
        return
    slots = out.slots.astype(np.int64)
    idx = to_device(np.concatenate([slots[row], rows.starts[row] + 1 + j, row, j]),
                    state.device, torch.int64)                             # [4D]
    d = row.size
    state.all_token_ids[idx[:d], idx[d:2 * d]] = rows.drafts[idx[2 * d:3 * d], idx[3 * d:]]
    if getattr(state, "tokens", None) is not None:   # the mirror checks' host copy (#27)
        state.tokens.record(rows.drafts, slots, rows.starts + 1, rows.num_drafts)


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
    row = np.repeat(np.arange(q.size, dtype=np.int64), per_row)
    index = (ends - per_row)[row] + np.arange(row.size, dtype=np.int64) - first[row]
    return index.astype(np.int64), first.astype(np.int64)


@dataclass
class Verified:
    """The verify of the sampled rows (``S`` of them), on the rank's device.

    Attributes:
        token_ids: ``[S, K + 1]`` int64 sampled ids (the first ``num_sampled`` of a row emitted).
        num_sampled, num_rejected: ``[S]`` int64.
        sample_out: the sampler's output over the virtual rows (logprobs), or None.
        virtual_first: ``[S]`` (host) index of each row's first virtual row in ``sample_out``.
    """
    token_ids: torch.Tensor
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor
    sample_out: object
    virtual_first: np.ndarray


def verify(logits: torch.Tensor, first: np.ndarray, rows_idx: np.ndarray, out, rows: SpecRows,
           positions_after: np.ndarray, state, num_spec_tokens: int) -> Verified:
    """Sample each position of the sampled rows and accept the longest matching draft prefix,
    all rows at once on the device (one sampler call over the ``N`` virtual rows, one
    acceptance kernel chain; no per-row Python, no host sync).

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
    vrow = np.repeat(np.arange(k.size, dtype=np.int64), n_virtual)  # [N'] virtual -> sampled row
    j = np.arange(vrow.size, dtype=np.int64) - vfirst[vrow]         # [N'] draft position
    src = first[rows_idx][vrow] + j
    v_slots = out.slots[rows_idx].astype(np.int64)[vrow]
    v_pos = positions_after[vrow] + j
    batch, _ = state.sampling_state.batch(v_slots, v_pos)
    v_total = rows.starts[rows_idx][vrow] + 1 + j                   # history through draft j
    idx = to_device(np.concatenate([src, vrow, j, v_total, rows_idx, k]), dev, torch.int64)
    nv, s = vrow.size, k.size
    src_t, vrow_t, j_t = idx[:nv], idx[nv:2 * nv], idx[2 * nv:3 * nv]
    total_t, rows_t, k_t = idx[3 * nv:4 * nv], idx[4 * nv:4 * nv + s], idx[4 * nv + s:]
    history = None
    if batch.penalty_rows is not None:
        pr = batch.penalty_rows
        s_t = to_device(v_slots, dev, torch.int64)[pr]
        history = TokenHistory(state.all_token_ids.index_select(0, s_t),
                               state.prefill_len.index_select(0, s_t), total_t[pr])
    so = sample(logits.index_select(0, src_t).float(), batch, history)
    sampled = torch.zeros(s, num_spec_tokens + 1, dtype=torch.int64, device=dev)
    sampled[vrow_t, j_t] = so.token_ids
    num_sampled, num_rejected = accept_rows(sampled, rows.drafts.index_select(0, rows_t), k_t)
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
        self._zeros: torch.Tensor | None = None  # [max_num_reqs, K] drafts of draft-free steps

    def prepare(self, out, state) -> np.ndarray:
        """Plan the step's rows and write the drafts; returns ``[R]`` corrected start positions
        (use them, not ``out.start_positions``, for the step's metadata)."""
        zeros, dev = self._zeros, state.all_token_ids.device
        if zeros is None or zeros.shape[0] < out.num_rows or zeros.device != dev:
            n = max(out.num_rows, state.all_token_ids.shape[0])   # max_num_reqs rows: made once
            zeros = self._zeros = torch.zeros(n, self.k, dtype=torch.int64, device=dev)
        self.rows = plan_rows(out, state, self.k, self.ngram, self.is_first or self.is_last, zeros)
        if self.is_first or self.is_last:
            write_drafts(state, out, self.rows)
        return self.rows.starts

    def logit_meta(self, meta, out):
        """Last rank: ``meta`` with ``last_token`` covering every decode row's ``1 + k`` tokens."""
        import dataclasses
        index, self.first = logit_index(out.num_scheduled_tokens, self.rows)
        return dataclasses.replace(meta, last_token=to_device(index, meta.slots.device, torch.int64))

    def sample(self, out, mask: np.ndarray, logits: torch.Tensor, state,
               payload: torch.Tensor) -> tuple[Verified, np.ndarray]:
        """Verify the sampled rows into ``payload`` (``[R, K + 3]`` int64: ids, num_sampled,
        num_rejected). Returns the verify and the ``[S]`` sampled step rows."""
        rows_idx = np.nonzero(mask)[0]
        pos = self.rows.starts[rows_idx] + out.num_scheduled_tokens[rows_idx] \
            - self.rows.num_drafts[rows_idx]
        v = verify(logits, self.first, rows_idx, out, self.rows, pos, state, self.k)
        w = self.k + 1
        if rows_idx.size == out.num_rows:     # every row samples: no row scatter
            payload[:, :w] = v.token_ids
            payload[:, w] = v.num_sampled
            payload[:, w + 1] = v.num_rejected
        else:
            r = to_device(rows_idx, payload.device, torch.int64)
            payload[r, :w] = v.token_ids
            payload[r, w] = v.num_sampled
            payload[r, w + 1] = v.num_rejected
        return v, rows_idx


def logprob_rows(v: Verified, rows_idx: np.ndarray, num_rows: int, ks: np.ndarray):
    """Per step row, the logprob payload of its emitted tokens: a list of ``(logprob, {id:
    logprob})`` (one per emitted token), or None for rows that asked for none. ``ks``: ``[S]``
    alternatives each sampled row asked for, -1 = no logprobs."""
    so = v.sample_out
    if so.logprobs is None or not (ks >= 0).any():
        return None
    lp = so.logprobs.float().cpu().tolist()
    num_sampled = v.num_sampled.cpu().tolist()
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
                        for t in range(num_sampled[j])]
    return outs
