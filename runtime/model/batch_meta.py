"""Per-step attention metadata of a mixed batch (prefill chunks and decodes together).

A step's batch is a flat run of T tokens in R rows, row after row. Row r belongs to cache slot
``slots[r]``, already has ``start_positions[r]`` tokens in the KV cache and brings
``query_lens[r]`` new ones. :class:`BatchMeta` is built once per step and shared by every layer of
the stage: token positions, KV write indices, the index of each row's last token, and the
attention groups (rows with one query token; rows with more), each with its padded query layout
and its boolean causal mask, so each layer runs at most two batched SDPA calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Key lengths are padded to a multiple of this, so a row's attention reductions run over the same
#: vector-aligned lengths whatever else is in the batch (see ``layers.attend``).
KV_ALIGN = 16


@dataclass(frozen=True)
class AttnGroup:
    """Rows attended together; queries padded to ``q_max``, keys to ``kv_len`` (the group's longest
    context rounded up to :data:`KV_ALIGN`; keys past a row's context are masked out).

    Attributes:
        slots: ``[Rg]`` cache slot of each row.
        gather: ``[Rg * q_max]`` flat token index (into T) of each padded query (pads repeat the
            row's last token, so every query has at least one key and SDPA yields no NaN).
        tokens: ``[Tg]`` token indices (into T) of the group's real tokens.
        padded: ``[Tg]`` their positions in the padded ``[Rg * q_max]`` layout.
        mask: ``[Rg, 1, q_max, kv_len]`` bool, True where a query may attend a key (causal).
        dense: no padding (every row has ``q_max`` tokens): padded order == token order.
    """
    slots: torch.Tensor
    gather: torch.Tensor
    tokens: torch.Tensor
    padded: torch.Tensor
    mask: torch.Tensor
    q_max: int
    kv_len: int
    dense: bool


@dataclass(frozen=True)
class BatchMeta:
    """Step metadata (see module doc). Shapes: R rows, T = sum(query_lens) tokens.

    Attributes:
        slots, start_positions, query_lens: ``[R]`` long, as given.
        positions: ``[T]`` long, absolute position of each token (= its KV cache index).
        token_slots: ``[T]`` long, cache slot of each token (KV write index, dim 1 of the cache).
        last_token: ``[R]`` long, index into T of each row's last token (logits are taken there).
        groups: the attention groups (1 or 2).
        slot_bounds: ``(min, max)`` slot as Python ints (range checks without a device sync).
        max_context: largest ``start + query_len`` of the batch (cache length that must exist;
            the cache is allocated rounded up to ``KV_ALIGN``).
    """
    slots: torch.Tensor
    start_positions: torch.Tensor
    query_lens: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    last_token: torch.Tensor
    groups: tuple[AttnGroup, ...]
    num_tokens: int
    slot_bounds: tuple[int, int]
    max_context: int

    @property
    def num_rows(self) -> int:
        """R, the number of rows (requests) in the step."""
        return int(self.slots.shape[0])

    @staticmethod
    def build(slots: torch.Tensor, start_positions: torch.Tensor, query_lens: torch.Tensor,
              device: str | torch.device = "cpu") -> "BatchMeta":
        """Build the step metadata; index arithmetic runs on the CPU (the tensor sizes it needs are
        Python ints), results are moved to ``device``.

        Args:
            slots, start_positions, query_lens: ``[R]`` integer tensors (or lists), R >= 1.
        Raises:
            ValueError: R == 0, mismatched lengths, a query length < 1 or a negative start.
        """
        slots, start, qlen = (torch.as_tensor(x, dtype=torch.long).cpu().reshape(-1)
                              for x in (slots, start_positions, query_lens))
        if not (slots.numel() == start.numel() == qlen.numel()) or slots.numel() == 0:
            raise ValueError(f"BatchMeta needs R >= 1 rows of equal length; got slots {slots.numel()}, "
                             f"start_positions {start.numel()}, query_lens {qlen.numel()}")
        if int(qlen.min()) < 1 or int(start.min()) < 0:
            raise ValueError("query_lens must be >= 1 and start_positions >= 0")
        ends = torch.cumsum(qlen, 0)
        offsets = ends - qlen
        row = torch.repeat_interleave(torch.arange(slots.numel()), qlen)
        positions = start[row] + torch.arange(int(ends[-1])) - offsets[row]
        is_decode = qlen == 1
        groups = [_group(idx, slots, start, qlen, offsets, device)
                  for idx in (is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0]) if idx.numel()]
        to = lambda t: t.to(device)  # noqa: E731
        return BatchMeta(slots=to(slots), start_positions=to(start), query_lens=to(qlen),
                         positions=to(positions), token_slots=to(slots[row]), last_token=to(ends - 1),
                         groups=tuple(groups), num_tokens=int(ends[-1]),
                         slot_bounds=(int(slots.min()), int(slots.max())),
                         max_context=int((start + qlen).max()))


def _group(rows: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, qlen: torch.Tensor,
           offsets: torch.Tensor, device: str | torch.device) -> AttnGroup:
    """Padded layout and causal mask for the batch rows ``rows`` (indices into R)."""
    q, st, off = qlen[rows], start[rows], offsets[rows]
    q_max, kv_len = int(q.max()), -(-int((st + q).max()) // KV_ALIGN) * KV_ALIGN
    i = torch.arange(q_max)
    clamped = torch.minimum(i[None, :], (q - 1)[:, None])           # [Rg, q_max]
    gather = (off[:, None] + clamped).reshape(-1)
    valid = (i[None, :] < q[:, None]).reshape(-1)
    query_pos = st[:, None] + clamped                                # absolute position per query
    mask = torch.arange(kv_len)[None, None, :] <= query_pos[:, :, None]
    return AttnGroup(slots=slots[rows].to(device), gather=gather.to(device),
                     tokens=gather[valid].to(device), padded=valid.nonzero()[:, 0].to(device),
                     mask=mask[:, None].to(device), q_max=q_max, kv_len=kv_len,
                     dense=bool(valid.all()))
