"""OpenAI's ``logit_bias`` as slot-indexed device tables: sparse token ids + biases per slot.

A request's bias (token id -> value in [-100, 100], at most :data:`MAX_LOGIT_BIAS` entries) is
written once at admission into two ``[max_num_reqs, MAX_LOGIT_BIAS]`` tables (ids and values,
zero-padded: a padding entry adds 0.0 to token 0). Each step gathers the biased rows' table rows
by slot (one ``index_select`` per table) and adds them to the logits with one ``scatter_add_``:
no per-row Python in the step. Whether any row of a step is biased is read from a host mask.

The bias goes on the logits the sampler draws from, before the penalties and temperature (vLLM's
order: logits processors, then penalties); returned logprobs stay those of the raw logits, as the
other parameters leave them. A bias of +100 makes a token all but certain, -100 all but banned
(OpenAI's documented meaning).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.host_copy import to_device

#: most entries one request's ``logit_bias`` may hold (OpenAI accepts 300 as well)
MAX_LOGIT_BIAS = 300
#: largest |bias| (OpenAI's range)
MAX_BIAS_VALUE = 100.0


def bias_arrays(pairs: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [K] int64, values [K] float32)`` of a request's ``[(token_id, bias), ...]``."""
    ids = np.array([int(p[0]) for p in pairs], dtype=np.int64)
    vals = np.array([float(p[1]) for p in pairs], dtype=np.float32)
    return ids, vals


class LogitBiasTable:
    """Every slot's logit bias on ``device``.

    Args:
        max_num_reqs: slots.
        device: where the last rank samples.
        width: entries per slot (:data:`MAX_LOGIT_BIAS`).
    """

    def __init__(self, max_num_reqs: int, device: torch.device, width: int = MAX_LOGIT_BIAS) -> None:
        self.device, self.width = device, width
        self.ids: torch.Tensor | None = None      # [max_num_reqs, width] int64, allocated on first use
        self.values: torch.Tensor | None = None   # [max_num_reqs, width] fp32, 0 = padding
        self.max_num_reqs = max_num_reqs
        self.biased_np = np.zeros(max_num_reqs, dtype=bool)   # [max_num_reqs] slot has a bias
        # exact host copies of the device tables (the after-step check compares the biased live
        # rows, docs/mirror_audit.md), allocated with them
        self.ids_np: np.ndarray | None = None      # [max_num_reqs, width] int64
        self.values_np: np.ndarray | None = None   # [max_num_reqs, width] float32

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ids is None:
            n, w, dev = self.max_num_reqs, self.width, self.device
            self.ids = torch.zeros(n, w, dtype=torch.int64, device=dev)
            self.values = torch.zeros(n, w, dtype=torch.float32, device=dev)
            self.ids_np = np.zeros((n, w), dtype=np.int64)
            self.values_np = np.zeros((n, w), dtype=np.float32)
        return self.ids, self.values

    def admit(self, slots: Sequence[int], params: Sequence) -> None:
        """Write the biases of newly admitted requests (``params[i].logit_bias``: ``[(id, bias)]``).
        Slots without a bias are only marked unbiased on the host (their stale rows are never
        gathered)."""
        s = np.asarray(slots, dtype=np.int64)
        pairs = [getattr(p, "logit_bias", None) or () for p in params]
        has = np.array([len(p) > 0 for p in pairs], dtype=bool)
        self.biased_np[s] = has
        if not has.any():
            return
        ids_t, vals_t = self._tables()
        rows = np.flatnonzero(has)
        ids = np.zeros((rows.size, self.width), dtype=np.int64)     # [k, width]
        vals = np.zeros((rows.size, self.width), dtype=np.float32)  # [k, width]
        for j, r in enumerate(rows):
            i, v = bias_arrays(pairs[r])
            ids[j, :i.size], vals[j, :v.size] = i, v
        idx = to_device(s[rows], self.device)
        ids_t[idx] = to_device(ids, self.device)
        vals_t[idx] = to_device(vals, self.device)
        self.ids_np[s[rows]], self.values_np[s[rows]] = ids, vals

    def biased_live(self, live: np.ndarray) -> np.ndarray:
        """``[B]`` slots of ``live`` (``[num_live]``) holding a bias: the rows the sampler may
        gather, so the rows the after-step check compares (empty before any bias was seen)."""
        if self.ids is None:
            return live[:0]
        return live[self.biased_np[live]]

    def gather(self, slots: np.ndarray, slots_t: torch.Tensor) -> tuple | None:
        """``(rows [B], ids [B, width], values [B, width])`` on the device for the biased rows of a
        step whose sampled rows sit in ``slots`` (``[R]`` host, ``slots_t`` the same on the
        device); None when no row is biased."""
        mask = self.biased_np[slots]
        if not mask.any():
            return None
        ids_t, vals_t = self._tables()
        rows = to_device(np.flatnonzero(mask).astype(np.int64), self.device)
        s = slots_t.index_select(0, rows)
        return rows, ids_t.index_select(0, s), vals_t.index_select(0, s)


def apply_logit_bias(logits: torch.Tensor, bias: tuple | None) -> torch.Tensor:
    """``logits`` ``[R, V]`` fp32 with each biased row's entries added (a new tensor when biased).

    Args:
        bias: :meth:`LogitBiasTable.gather`'s triple, or None (``logits`` returned as is).
    """
    if bias is None:
        return logits
    rows, ids, vals = bias
    out = logits.clone()
    sub = out.index_select(0, rows).scatter_add_(1, ids, vals)
    out.index_copy_(0, rows, sub)
    return out


def row_bias(params: Sequence, device: torch.device | str) -> tuple | None:
    """The bias triple of a per-row batch (``SamplingBatch.build``), or None when no row has one."""
    pairs = [getattr(p, "logit_bias", None) or () for p in params]
    rows = [i for i, p in enumerate(pairs) if p]
    if not rows:
        return None
    width = max(len(pairs[r]) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    vals = np.zeros((len(rows), width), dtype=np.float32)
    for j, r in enumerate(rows):
        i, v = bias_arrays(pairs[r])
        ids[j, :i.size], vals[j, :v.size] = i, v
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.from_numpy(ids).to(device), torch.from_numpy(vals).to(device))
