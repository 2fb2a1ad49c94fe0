"""Per-step attention metadata of a mixed batch (prefill chunks and decodes together).

A step's batch is a flat run of T tokens in R rows, row after row. Row r belongs to cache slot
``slots[r]``, already has ``start_positions[r]`` tokens in the KV cache and brings
``query_lens[r]`` new ones. :class:`BatchMeta` is built once per step and shared by every layer of
the stage: token positions, KV write indices, the index of each row's last token, and the
attention groups (rows with one query token; rows with more), each with its padded query layout
and its boolean causal mask, so each layer runs at most two batched SDPA calls.

Paged KV cache (``docs/kv_cache.md``): the cache is ``[num_blocks, block_size, KVH, D]`` per layer
and each slot's tokens live in the blocks of its row of the block table. The step carries the
layout agreed with the GPU kernels: ``slot_mapping`` (flat write index per token),
``block_tables`` (the rows' block-table rows), ``seq_lens``, ``query_start_loc``,
``max_query_len`` / ``max_seq_len``; the CPU path also gets, per group, the flat cache index of
every key it attends (``kv_index``), computed once per step for all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        kv_index: ``[Rg * kv_len]`` long, flat cache index (``block * block_size + offset``) of
            key position p of each row (positions past the row's blocks read block 0: masked).
        memo: gather indices the attention derives once per step (keyed by KVH), shared by all
            layers.
    """
    slots: torch.Tensor
    gather: torch.Tensor
    tokens: torch.Tensor
    padded: torch.Tensor
    mask: torch.Tensor
    q_max: int
    kv_len: int
    dense: bool
    kv_index: torch.Tensor
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def _replace_device(self, device: str | torch.device) -> "AttnGroup":
        to = lambda t: t.to(device)  # noqa: E731
        return AttnGroup(to(self.slots), to(self.gather), to(self.tokens), to(self.padded),
                         to(self.mask), self.q_max, self.kv_len, self.dense, to(self.kv_index))


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
        max_context: largest ``start + query_len`` of the batch (= ``max_seq_len``).
        slot_mapping: ``[T]`` long, flat KV write index ``block_id * block_size + offset`` of
            each token (``-1``: do not write; only padding rows of CUDA graphs).
        block_tables: ``[R, max_blocks_in_step]`` int32, each row's block-table row.
        seq_lens: ``[R]`` int32, context length after this step (start + query_len).
        query_start_loc: ``[R + 1]`` int32, cumulative query lengths.
        max_query_len, max_seq_len: Python ints.
        block_size: tokens per block; block_bounds: ``(min, max)`` block id read or written.
        own_layout: built without a block table; a :class:`~runtime.model.stage.StageModel`
            rebuilds it with its own fixed contiguous table (tests and one-off runs).
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
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    block_bounds: tuple[int, int]
    own_layout: bool = False

    @property
    def num_rows(self) -> int:
        """R, the number of rows (requests) in the step."""
        return int(self.slots.shape[0])

    @staticmethod
    def build(slots: torch.Tensor, start_positions: torch.Tensor, query_lens: torch.Tensor,
              device: str | torch.device = "cpu", block_table: torch.Tensor | None = None,
              block_size: int = 16, attention_groups: bool = True) -> "BatchMeta":
        """Build the step metadata; index arithmetic runs on the CPU (the tensor sizes it needs are
        Python ints), results are moved to ``device``.

        Args:
            slots, start_positions, query_lens: ``[R]`` integer tensors (or lists), R >= 1.
            block_table: ``[max_num_reqs, max_blocks_per_req]`` CPU block table (slot-indexed);
                None: the contiguous layout :func:`contiguous_block_table` with room for
                ``max_context`` tokens per slot up to the largest slot (tests, one-off runs).
            block_size: tokens per block.
            attention_groups: build the CPU path's groups (padded layouts, masks, key indices);
                the GPU fast path reads only the paged fields and skips them (``groups == ()``).
        Raises:
            ValueError: R == 0, mismatched lengths, a query length < 1 or a negative start, a
                slot outside the block table, or a row whose context needs more blocks than its
                block-table row holds.
        """
        slots, start, query_len = (torch.as_tensor(x, dtype=torch.long).cpu().reshape(-1)
                              for x in (slots, start_positions, query_lens))
        if not (slots.numel() == start.numel() == query_len.numel()) or slots.numel() == 0:
            raise ValueError(f"BatchMeta needs R >= 1 rows of equal length; got slots {slots.numel()}, "
                             f"start_positions {start.numel()}, query_lens {query_len.numel()}")
        if int(query_len.min()) < 1 or int(start.min()) < 0:
            raise ValueError("query_lens must be >= 1 and start_positions >= 0")
        ends = torch.cumsum(query_len, 0)
        offsets = ends - query_len
        row = torch.repeat_interleave(torch.arange(slots.numel()), query_len)
        positions = start[row] + torch.arange(int(ends[-1])) - offsets[row]
        seq = start + query_len
        max_seq = int(seq.max())
        own_layout = block_table is None
        if own_layout:
            block_table = contiguous_block_table(int(slots.max()) + 1, max_seq, block_size)
        block_table = torch.as_tensor(block_table).cpu().long()
        width = -(-max_seq // block_size)
        if int(slots.min()) < 0 or int(slots.max()) >= block_table.shape[0]:
            raise ValueError(f"slot out of range [0, {block_table.shape[0]}): {slots.tolist()}")
        if width > block_table.shape[1]:
            raise ValueError(f"context {max_seq} needs {width} blocks of {block_size}; the block "
                             f"table holds {block_table.shape[1]} per slot")
        tables = block_table[slots, :width]                              # [R, width]
        tok_slots = slots[row]
        slot_mapping = tables[row, positions // block_size] * block_size + positions % block_size
        is_decode = query_len == 1
        groups = [_group(idx, slots, start, query_len, offsets, tables, block_size, device)
                  for idx in (is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0])
                  if idx.numel() and attention_groups]
        if attention_groups:
            used = torch.cat([g.kv_index for g in groups] + [slot_mapping]) // block_size
        else:  # the blocks each row reads: its first ceil(seq_len / block_size) table entries
            need = -(-seq // block_size)
            used = tables[torch.arange(width)[None, :] < need[:, None]]
        # non_blocking: a blocking CPU -> CUDA copy synchronises the stream (waits for the GPU)
        to = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        i32 = lambda t: t.to(dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        return BatchMeta(slots=to(slots), start_positions=to(start), query_lens=to(query_len),
                         positions=to(positions), token_slots=to(tok_slots), last_token=to(ends - 1),
                         groups=tuple(g._replace_device(device) for g in groups),
                         num_tokens=int(ends[-1]),
                         slot_bounds=(int(slots.min()), int(slots.max())), max_context=max_seq,
                         slot_mapping=to(slot_mapping), block_tables=i32(tables), seq_lens=i32(seq),
                         query_start_loc=i32(torch.cat([torch.zeros(1, dtype=torch.long), ends])),
                         max_query_len=int(query_len.max()), max_seq_len=max_seq,
                         block_size=block_size,
                         block_bounds=(int(used.min()), int(used.max())), own_layout=own_layout)


def contiguous_block_table(num_slots: int, max_len: int, block_size: int) -> torch.Tensor:
    """``[num_slots, ceil(max_len / block_size)]`` long: slot s owns blocks ``s * W .. s * W + W - 1``
    (the layout of the old slot-contiguous cache; used when no allocator is involved)."""
    width = -(-max_len // block_size)
    return torch.arange(num_slots * width, dtype=torch.long).view(num_slots, width)


def _group(rows: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, query_len: torch.Tensor,
           offsets: torch.Tensor, tables: torch.Tensor, block_size: int,
           device: str | torch.device) -> AttnGroup:
    """Padded layout, causal mask and key indices for the batch rows ``rows`` (indices into R);
    tensors stay on the CPU (``AttnGroup._replace_device`` moves them)."""
    query_len, st, off = query_len[rows], start[rows], offsets[rows]
    q_max, kv_len = int(query_len.max()), -(-int((st + query_len).max()) // KV_ALIGN) * KV_ALIGN
    i = torch.arange(q_max)
    clamped = torch.minimum(i[None, :], (query_len - 1)[:, None])   # [Rg, q_max]
    gather = (off[:, None] + clamped).reshape(-1)
    valid = (i[None, :] < query_len[:, None]).reshape(-1)
    query_pos = st[:, None] + clamped                                # absolute position per query
    mask = torch.arange(kv_len)[None, None, :] <= query_pos[:, :, None]
    key_pos = torch.arange(kv_len)
    col = torch.clamp(key_pos // block_size, max=tables.shape[1] - 1)   # pads past the table: masked
    kv_index = tables[rows][:, col] * block_size + key_pos % block_size  # [Rg, kv_len]
    return AttnGroup(slots=slots[rows], gather=gather, tokens=gather[valid],
                     padded=valid.nonzero()[:, 0], mask=mask[:, None], q_max=q_max, kv_len=kv_len,
                     dense=bool(valid.all()), kv_index=kv_index.reshape(-1))
