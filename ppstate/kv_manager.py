"""Scheduler-side KV-cache bookkeeping: the :class:`~ppstate.blocks.BlockPool`, prefix-cache
lookups and the per-step block-table deltas every rank applies.

Blocks are taken when a step is *scheduled*, for exactly the tokens it computes (with PP the
scheduler runs ``pp_size + 1`` steps ahead of the results, so a row's blocks must exist before any
rank runs it). A row that computes tokens ``[start, start + n)`` makes its request hold
``ceil((start + n) / block_size)`` blocks. Full prompt blocks are hashed (parent hash, token ids)
and registered when the chunk that computes them is scheduled; ranks run steps in order, so a
later hit always reads a block written before (in the same step, each layer writes before it
attends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ppstate.block_digest import BlockDigests
from ppstate.block_states import CACHED
from ppstate.blocks import BlockPool, block_hashes
from ppstate.scalars import ONE_I64

if TYPE_CHECKING:
    from ppstate.budget import SchedulerConfig
    from ppstate.request import Request


class KVManager:
    """Block pool + the block-table deltas of the step being built.

    Args:
        config: ``num_kv_blocks``, ``block_size``, ``enable_prefix_caching``,
            ``watermark_blocks`` of the scheduler configuration.
    """

    def __init__(self, config: "SchedulerConfig") -> None:
        self.pool = BlockPool(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.block_size = config.block_size
        self.block_size_np = np.array(config.block_size, dtype=np.int64)  # 0-d (ppstate.scalars)
        self.watermark = config.watermark_blocks
        # blocks in each slot's block-table row (= len(pool.table(owner))): lets the scheduler
        # tell, for all decode rows at once, whose next token needs a new block
        self.held = np.zeros(config.max_num_seqs, dtype=np.int64)   # [max_num_reqs]
        # each slot's row as the ranks build it from the deltas, and its digest (sent per row)
        self.digests = BlockDigests(config.max_num_seqs,
                                    -(-config.max_model_len // config.block_size))
        # the step's deltas, in order: parts ((slots, cols, ids), [k] int64 each) and, since the
        # last part, the ones recorded one request at a time
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._slots: list[int] = []
        self._cols: list[int] = []
        self._ids: list[int] = []

    # ------------------------------------------------------------------ deltas
    def _record(self, slot: int, first_col: int, blocks: list[int]) -> None:
        if blocks:
            self.held[slot] = first_col + len(blocks)
        self._slots += [slot] * len(blocks)
        self._cols += range(first_col, first_col + len(blocks))
        self._ids += blocks

    def _flush(self) -> None:
        """Move the deltas recorded one request at a time into a part (keeps their order)."""
        if self._slots:
            self._parts.append((np.array(self._slots, dtype=np.int64),
                                np.array(self._cols, dtype=np.int64),
                                np.array(self._ids, dtype=np.int64)))
            self._slots, self._cols, self._ids = [], [], []

    def take_deltas(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(slots, cols, block_ids)`` each ``[U]`` int32 recorded since the last call:
        ``block_table[slots[u], cols[u]] = block_ids[u]`` on every rank."""
        self._flush()
        parts, self._parts = self._parts, []
        if not parts:
            return (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32),
                    np.zeros(0, dtype=np.int32))
        cols = parts[0] if len(parts) == 1 else [np.concatenate(c) for c in zip(*parts)]
        return cols[0].astype(np.int32), cols[1].astype(np.int32), cols[2].astype(np.int32)

    # ------------------------------------------------------------------ admission
    def prefix_hit(self, req: "Request") -> list[int]:
        """Cached blocks equal to the head of ``req``'s prefill tokens (read-only lookup); at least
        one token is always left to compute (its logits give the first sampled token)."""
        tokens = req.prefill_tokens
        req.block_hashes = block_hashes(tokens, self.block_size)
        return self.pool.match_prefix(req.block_hashes, tokens, (len(tokens) - 1) // self.block_size)

    def admissible_tokens(self, hit: list[int], chunk: int) -> int:
        """Tokens (<= ``chunk``) of a new request's first chunk that fit while keeping
        ``watermark`` blocks free; hit blocks that are cached leave the free count too."""
        pool = self.pool
        cached = int(np.count_nonzero(pool.states.code[np.asarray(hit, dtype=np.int64)] == CACHED))
        avail = pool.num_free - cached - self.watermark
        return max(0, min(chunk, avail * self.block_size))

    def start(self, req: "Request", hit: list[int]) -> int:
        """Give ``req`` (just placed in ``req.slot``) its prefix-hit blocks; returns cached tokens."""
        self.pool.share(req.req_id, hit)
        self._record(req.slot, 0, hit)
        req.num_registered = len(hit)
        hit_tokens = len(hit) * self.block_size
        self.pool.record_lookup(len(req.prefill_tokens), hit_tokens)
        return hit_tokens

    # ------------------------------------------------------------------ growth
    def tokens_fit(self, req: "Request", computed: int, want: int) -> int:
        """How many of ``want`` new tokens after ``computed`` the free blocks can hold."""
        held = len(self.pool.table(req.req_id))
        room = (held + self.pool.num_free) * self.block_size - computed
        return max(0, min(want, room))

    def grow(self, req: "Request", num_tokens: int) -> None:
        """Make ``req`` hold blocks for its first ``num_tokens`` tokens (deltas recorded).

        Raises:
            BlockError: not enough free blocks (callers size chunks with :meth:`tokens_fit`).
        """
        need = self.pool.blocks_needed(req.req_id, num_tokens)
        if need:
            first = len(self.pool.table(req.req_id))
            self._record(req.slot, first, self.pool.allocate(req.req_id, need))

    def grow_by_one_block(self, slots: np.ndarray, req_ids: Sequence[str]) -> None:
        """Give each of the requests ``req_ids`` (in ``slots``, ``[k]``, distinct; each holding
        exactly the blocks its computed tokens fill) one more block, as :meth:`grow` would one by
        one (same block ids, same deltas in the same order). A decode row's token never completes
        a prefill block, so there is nothing to register.

        Raises:
            BlockError: fewer than ``k`` blocks free (callers check ``pool.num_free``).
        """
        if not req_ids:
            return
        blocks = self.pool.allocate_one_each(req_ids)                 # [k]
        cols = self.held[slots]                                        # [k]
        self._flush()
        self._parts.append((slots, cols, blocks))
        self.held[slots] = cols + ONE_I64

    def register_full(self, req: "Request", computed: int) -> None:
        """Hash-register the full prefill blocks now covered by ``computed`` scheduled tokens."""
        bs, tokens = self.block_size, req.prefill_tokens
        upto = min(computed, len(tokens)) // bs
        for i in range(req.num_registered, upto):
            self.pool.register(req.req_id, i, req.block_hashes[i], tokens[i * bs:(i + 1) * bs])
        req.num_registered = max(req.num_registered, upto)

    def free(self, req: "Request") -> None:
        """Release ``req``'s blocks (finish, abort, preemption; ``req.slot`` still set)."""
        self.pool.free(req.req_id)
        if req.slot >= 0:
            self.held[req.slot] = 0
        req.num_registered = 0
