"""KV-cache block pool: fixed-size blocks, a free list, per-request block tables, reference counts,
and the prefix cache (full blocks hashed by (parent hash, token ids), LRU eviction).

The scheduler owns the only pool; every rank holds identical block tables because each
``SchedulerOutput`` carries the table deltas (invariant 9 in ``specs/invariants.md``). Block states
follow ``specs/block.yaml`` (:class:`~ppstate.block_states.BlockStates`): free -> allocated ->
free, or -> cached (ref count 0, hash kept) -> allocated again on a prefix hit, or -> free when
evicted. Per-block work is numpy; the machine table validates each array transition.

Design facts from vLLM's ``KVCacheManager`` and nano-vllm's ``BlockManager``: blocks are freed in
reverse table order so a prefix's head stays cached longest; a block is shared only when full and
hashed; a hit is accepted only when the block's stored token ids equal the request's (so a hash
collision can never alias two contents).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from ppstate.block_states import ALLOCATED, CACHED, FREE, BlockStates
from ppstate.errors import BlockError
from ppstate.table_binding import check_guards

#: Parent hash of a request's first block.
ROOT_HASH = -1


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: ``h_i = hash((h_{i-1}, *block_i))``.

    Returns ``len(token_ids) // block_size`` Python ints. Deterministic across processes (tuples of
    ints hash without PYTHONHASHSEED salting); collisions are harmless because a hit also compares
    the token ids (:meth:`BlockPool.match_prefix`).
    """
    out, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, *token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_blocks: blocks per rank (>= 1).
        block_size: tokens per block (>= 1).
        enable_prefix_caching: keep hashed blocks after release and serve prefix hits.
    Raises:
        BlockError: a size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise BlockError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.states = BlockStates(num_blocks)
        check_guards(self.states.table, BlockPool)   # specs/block.yaml's is_hashed
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)   # [num_blocks]
        self.block_hash: dict[int, int] = {}                    # block id -> hash (full blocks)
        self.block_tokens: dict[int, tuple[int, ...]] = {}      # block id -> its token ids
        self._by_hash: dict[int, int] = {}                      # hash -> block id
        self._free: deque[int] = deque(range(num_blocks))       # lowest id first
        self._lru: OrderedDict[int, None] = OrderedDict()       # cached blocks, oldest first
        self.tables: dict[str, list[int]] = {}                  # req_id -> block ids
        self.query_tokens = 0   # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0     # of which served from cached blocks

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free + cached-evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def table(self, req_id: str) -> list[int]:
        """Block ids of ``req_id`` (empty when it holds none)."""
        return self.tables.get(req_id, [])

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """New blocks ``req_id`` needs so that its first ``num_tokens`` tokens have a block."""
        return max(0, -(-num_tokens // self.block_size) - len(self.table(req_id)))

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate: hit tokens / looked-up prompt tokens (0 before any lookup)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    # ------------------------------------------------------------------ allocation
    def _take(self, n: int) -> list[int]:
        """``n`` block ids off the free list, then (when it runs dry) evicted from the LRU end of
        the cached blocks (their hashes forgotten, ``evict`` fired). The caller checked
        ``n <= num_free`` and fires ``allocate``."""
        free = self._free
        take = [free.popleft() for _ in range(min(n, len(free)))]
        if len(take) < n:
            evicted = [self._lru.popitem(last=False)[0] for _ in range(n - len(take))]
            self.states.fire(evicted, "evict")
            for b in evicted:
                del self._by_hash[self.block_hash.pop(b)]
                del self.block_tokens[b]
            take += evicted
        return take

    def allocate(self, req_id: str, n: int) -> list[int]:
        """Append ``n`` fresh blocks to ``req_id``'s table (evicting LRU cached blocks when the
        free list is empty) and return their ids.

        Raises:
            BlockError: fewer than ``n`` blocks free (nothing is changed then).
        """
        if n > self.num_free:
            raise BlockError(f"request {req_id!r} needs {n} blocks, {self.num_free} free")
        if n <= 0:
            return []
        take = self._take(n)
        self.states.fire(take, "allocate")
        self.ref_count[take] = 1
        self.tables.setdefault(req_id, []).extend(take)
        return take

    def allocate_one_each(self, req_ids: Sequence[str]) -> np.ndarray:
        """One fresh block appended to the table of each of ``req_ids`` (distinct requests that
        hold a table), in order: the same blocks as :meth:`allocate` ``(req_id, 1)`` called for
        each in turn, with one state-machine firing for all. Returns the ids (``[len(req_ids)]``
        int64).

        Raises:
            BlockError: fewer than ``len(req_ids)`` blocks free (nothing is changed then).
        """
        n = len(req_ids)
        if n > self.num_free:
            raise BlockError(f"{n} requests need a block each, {self.num_free} free")
        take = self._take(n)
        ids = np.array(take, dtype=np.int64)                    # [n]
        self.states.fire(ids, "allocate")
        self.ref_count[ids] = 1
        tables = self.tables
        for rid, b in zip(req_ids, take):
            tables[rid].append(b)
        return ids

    def match_prefix(self, hashes: Sequence[int], token_ids: Sequence[int],
                     max_blocks: int) -> list[int]:
        """Longest run of cached blocks equal to the first full blocks of ``token_ids``.

        Args:
            hashes: :func:`block_hashes` of ``token_ids``.
            max_blocks: at most this many blocks (the scheduler keeps >= 1 token to compute).
        Returns:
            block ids (read-only lookup; :meth:`share` takes them).
        """
        if not self.enable_prefix_caching:
            return []
        out, bs = [], self.block_size
        for i, h in enumerate(hashes[:max_blocks]):
            b = self._by_hash.get(h)
            if b is None or self.block_tokens[b] != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            out.append(b)
        return out

    def share(self, req_id: str, blocks: Sequence[int]) -> None:
        """Start ``req_id``'s (empty) table with the prefix-hit ``blocks`` (one more reference each).

        Raises:
            BlockError: the request already holds blocks, or a block is not hashed.
        """
        if self.table(req_id):
            raise BlockError(f"request {req_id!r} already holds blocks; prefix hits come first")
        ids = np.asarray(blocks, dtype=np.int64)
        if not self.is_hashed(ids).all():   # the guard of share / reuse
            raise BlockError(f"request {req_id!r}: only hashed blocks can be shared")
        cached = ids[self.states.code[ids] == CACHED]
        self.states.fire(ids[self.states.code[ids] == ALLOCATED], "share")
        self.states.fire(cached, "reuse")
        for b in cached.tolist():
            del self._lru[b]
        self.ref_count[ids] += 1
        self.tables[req_id] = list(blocks)

    def register(self, req_id: str, index: int, h: int, tokens: Sequence[int]) -> None:
        """Record that block ``index`` of ``req_id``'s table is full with ``tokens`` (hash ``h``),
        making it shareable. No-op when prefix caching is off, the block is already hashed, or
        another block already holds ``h`` (same content computed twice: the first one stays)."""
        if not self.enable_prefix_caching or h in self._by_hash:
            return
        b = self.tables[req_id][index]
        if b in self.block_hash:
            return
        self.block_hash[b], self.block_tokens[b], self._by_hash[h] = h, tuple(tokens), b

    def is_hashed(self, ids: np.ndarray) -> np.ndarray:
        """Guard of ``share`` / ``reuse`` / ``release_cached`` (specs/block.yaml): ``[n]`` bool,
        each block of ``ids`` (``[n]`` int64) holds a registered full-block hash."""
        return np.fromiter((b in self.block_hash for b in ids.tolist()), dtype=bool,
                           count=ids.size)

    def free(self, req_id: str) -> list[int]:
        """Drop ``req_id``'s table (tail first): each block loses one reference; a block left with
        none becomes cached (hashed) or free. Returns the table. Unknown id: returns []."""
        table = self.tables.pop(req_id, [])
        if not table:
            return table
        ids = np.asarray(table[::-1], dtype=np.int64)
        self.ref_count[ids] -= 1
        last = self.ref_count[ids] == 0
        hashed = self.is_hashed(ids)   # the guard of release_cached
        self.states.fire(ids[~last], "unref")
        to_cache, to_free = ids[last & hashed], ids[last & ~hashed]
        self.states.fire(to_cache, "release_cached")
        self.states.fire(to_free, "release")
        self._lru.update((b, None) for b in to_cache.tolist())
        self._free.extend(to_free.tolist())
        return table

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one prefix lookup (tokens) for :attr:`hit_rate`."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Invariant 9 (``specs/invariants.md``); raises BlockError naming the first violation.

        free + allocated + cached = num_blocks and match the free list / LRU; ref_count equals
        the number of table references; ref_count > 0 exactly for allocated blocks; a block in two
        tables (or twice in any) is hashed (shared read-only); cached blocks are hashed.
        """
        code = self.states.code
        refs = np.zeros(self.num_blocks, dtype=np.int64)
        for req_id, table in self.tables.items():
            if len(set(table)) != len(table):
                raise BlockError(f"request {req_id!r} holds a block twice: {table}")
            np.add.at(refs, np.asarray(table, dtype=np.int64), 1)
        if not np.array_equal(refs, self.ref_count):
            b = int(np.nonzero(refs != self.ref_count)[0][0])
            raise BlockError(f"block {b}: ref_count {self.ref_count[b]} != {refs[b]} table refs")
        if not np.array_equal(refs > 0, code == ALLOCATED):
            b = int(np.nonzero((refs > 0) != (code == ALLOCATED))[0][0])
            raise BlockError(f"block {b}: state code {code[b]} with {refs[b]} references")
        shared = np.nonzero(refs > 1)[0].tolist()
        if any(b not in self.block_hash for b in shared):
            raise BlockError(f"unhashed block shared by several requests: {shared}")
        if sorted(self._free) != np.nonzero(code == FREE)[0].tolist() or len(set(self._free)) != len(self._free):
            raise BlockError("free list differs from the blocks in state free")
        if sorted(self._lru) != np.nonzero(code == CACHED)[0].tolist():
            raise BlockError("LRU differs from the blocks in state cached")
        if any(b not in self.block_hash for b in self._lru):
            raise BlockError("a cached block has no hash")
        if len(self._free) + len(self._lru) + int((code == ALLOCATED).sum()) != self.num_blocks:
            raise BlockError("free + cached + allocated != num_blocks")
        if {self._by_hash[h] for h in self._by_hash} != set(self.block_hash) or \
                any(self._by_hash[h] != b for b, h in self.block_hash.items()):
            raise BlockError("hash index and block hashes disagree")
