"""KV block pool: exact states after event sequences, and a hypothesis state machine against a
plain dict model (allocate / append / free / share via prefix hit / evict), invariants after
every step."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ppstate.block_states import ALLOCATED, CACHED, FREE, BlockStates
from ppstate.blocks import BlockPool, block_hashes
from ppstate.errors import BlockError


def test_illegal_edge_names_block_and_state_and_changes_nothing():
    s = BlockStates(3)
    s.fire([0], "allocate")
    with pytest.raises(BlockError, match="block 1 in state 'free' cannot take trigger 'release'"):
        s.fire([0, 1], "release")
    assert s.code.tolist() == [ALLOCATED, FREE, FREE]


def test_prefix_hit_shares_blocks_and_eviction_is_lru():
    pool = BlockPool(4, 2)
    toks = [5, 6, 7, 8, 9]
    pool.allocate("a", 3)
    for i, h in enumerate(block_hashes(toks, 2)):
        pool.register("a", i, h, toks[2 * i:2 * i + 2])
    hit = pool.match_prefix(block_hashes(toks, 2), toks, max_blocks=2)
    assert hit == [0, 1]
    pool.share("b", hit)
    assert pool.ref_count.tolist() == [2, 2, 1, 0]
    pool.check_invariants()
    assert pool.free("a") == [0, 1, 2]
    assert pool.states.code.tolist() == [ALLOCATED, ALLOCATED, FREE, FREE]
    pool.free("b")                       # tail first: block 1 then block 0 into the LRU
    assert list(pool._lru) == [1, 0] and pool.num_free == 4
    assert pool.allocate("c", 3) == [3, 2, 1]  # free list first, then the oldest cached block
    assert pool.match_prefix(block_hashes(toks, 2), toks, 2) == [0]
    pool.check_invariants()
    with pytest.raises(BlockError, match="needs 2 blocks, 1 free"):
        pool.allocate("d", 2)


def test_collision_with_other_tokens_is_a_miss_and_caching_off_never_hits():
    pool = BlockPool(2, 2)
    pool.allocate("a", 1)
    pool.register("a", 0, 123, (1, 2))
    assert pool.match_prefix([123], [1, 3], 1) == []
    off = BlockPool(2, 2, enable_prefix_caching=False)
    off.allocate("a", 1)
    off.register("a", 0, 123, (1, 2))
    assert off.match_prefix([123], [1, 2], 1) == [] and off.free("a") == [0]
    assert off.states.code.tolist() == [FREE, FREE]


NUM_BLOCKS, BS = 6, 2
PROMPTS = [(1, 2, 3, 4, 5), (1, 2, 3, 4, 9), (7, 7, 7)]


class PoolMachine(RuleBasedStateMachine):
    """Model: ``tables`` req -> list of (block, hashed-content or None); the pool must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.model: dict[str, list[int]] = {}       # req -> blocks
        self.content: dict[int, tuple] = {}          # hashed block -> tokens (cache contents)
        self.n = 0

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def admit(self, p):
        toks, rid = PROMPTS[p], f"r{self.n}"
        self.n += 1
        hashes = block_hashes(toks, BS)
        hit = self.pool.match_prefix(hashes, toks, (len(toks) - 1) // BS)
        for i, b in enumerate(hit):
            assert self.content[b] == toks[i * BS:(i + 1) * BS]
        need = -(-len(toks) // BS) - len(hit)
        if need > self.pool.num_free - sum(self.pool.states.code[hit] == CACHED):
            return
        self.pool.share(rid, hit)
        new = self.pool.allocate(rid, need)
        for b in new:  # evicted blocks lose their content
            self.content.pop(b, None)
        self.model[rid] = hit + new
        for i, h in enumerate(hashes):
            self.pool.register(rid, i, h, toks[i * BS:(i + 1) * BS])
            b = self.pool.table(rid)[i]
            if b in self.pool.block_hash:
                self.content[b] = self.pool.block_tokens[b]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 3))
    def append(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        if n > self.pool.num_free:
            with pytest.raises(BlockError):
                self.pool.allocate(rid, n)
            return
        new = self.pool.allocate(rid, n)
        for b in new:
            self.content.pop(b, None)
        self.model[rid] += new

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        assert self.pool.free(rid) == self.model.pop(rid)
        assert self.pool.free(rid) == []  # returns exactly once

    @invariant()
    def agrees_with_model(self):
        self.pool.check_invariants()
        assert self.pool.tables == {r: t for r, t in self.model.items() if t}
        owned = [b for t in self.model.values() for b in t]
        refs = np.bincount(np.asarray(owned, dtype=np.int64), minlength=NUM_BLOCKS)
        assert refs.tolist() == self.pool.ref_count.tolist()
        cached = set(self.content) - set(owned)
        assert set(self.pool._lru) == cached
        assert self.pool.num_free == NUM_BLOCKS - len(set(owned))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
