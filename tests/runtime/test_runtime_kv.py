"""Paged KV cache on real pipelines (real model, worker processes), checked token by token
against transformers: block sizes 1 / 64, prefix caching on / off, a KV budget so small that
requests are preempted and recomputed, a shared system prompt whose second use computes only its
suffix, and an abort of a request holding shared prefix blocks. Engines are module-scoped."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from ppstate.testing import assert_invariants
from runtime.config import EngineConfig
from runtime.engine import RequestRejected
from runtime.sampling_params import SamplingParams
from engine_harness import EngineThread
from reference import greedy_reference

pytestmark = pytest.mark.slow

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
RNG = random.Random(18)
SHORT = [[RNG.randrange(100, 40000) for _ in range(RNG.randrange(3, 12))] for _ in range(4)]
MEDIUM = [[RNG.randrange(100, 40000) for _ in range(RNG.randrange(20, 60))] for _ in range(6)]
SYSTEM = [RNG.randrange(100, 40000) for _ in range(200)]


def _engine(**kw) -> EngineThread:
    base = dict(max_num_seqs=8, max_model_len=256, max_prefill_chunk=32,
                max_num_batched_tokens=128, step_timeout_s=60.0)
    base.update(kw)
    return EngineThread(EngineConfig(**base))


def _tokens(eng, prompts, prefix):
    res = eng.generate(prompts, GREEDY, prefix=prefix)
    assert [r["finish_reason"] for r in res] == ["length"] * len(prompts)
    return [tuple(r["token_ids"]) for r in res]


def _pool_is_whole(eng):
    pool = eng.engine.sched.kv.pool
    pool.check_invariants()
    assert pool.tables == {} and pool.num_free == pool.num_blocks


@pytest.fixture(scope="module")
def pp2_block64():
    eng = _engine(pp_size=2, block_size=64)
    yield eng
    eng.close()


def test_block_size_1_pp1_prefix_caching_off():
    eng = _engine(pp_size=1, block_size=1, enable_prefix_caching=False, max_model_len=64)
    try:
        got = _tokens(eng, SHORT + SHORT[:1], "b1-")      # a repeated prompt: no hit when off
        stats = eng.engine.stats()
        _pool_is_whole(eng)
    finally:
        eng.close()
    assert got == [greedy_reference(tuple(p), NEW) for p in SHORT + SHORT[:1]]
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["kv_blocks_cached"] == 0


async def test_small_kv_budget_preempts_and_recomputes_pp3(pp_engine):
    # 2400KB holds 9-10 blocks of 16 tokens on a rank of 10-11 layers (fp32): six 20-60 token
    # prompts cannot all stay resident, so running requests are preempted and recomputed.
    # pp_engine (the ppstate pytest plugin) stops the workers even if an assert fails mid-way.
    engine = await pp_engine(pp_size=3, kv_cache_memory="2400KB", max_num_seqs=8,
                             max_model_len=256, max_prefill_chunk=32, max_num_batched_tokens=128,
                             step_timeout_s=60.0)
    eng = SimpleNamespace(engine=engine)
    res = await asyncio.gather(*(EngineThread.collect(eng, f"pre-{i}", p, GREEDY)
                                 for i, p in enumerate(MEDIUM)))
    got = [tuple(r["token_ids"]) for r in res]
    stats = engine.stats()
    _pool_is_whole(eng)
    cap = stats["kv_blocks_total"] * 16
    with pytest.raises(RequestRejected, match=rf"needs KV cache for 199 tokens; this "
                                              rf"server's KV cache holds {cap} tokens") as err:
        engine.add_request("too-long", [5] * 100, SamplingParams(max_tokens=100))
    assert err.value.field == "max_tokens"
    assert stats["kv_blocks_total"] <= 10 and stats["num_preemptions"] > 0
    assert got == [greedy_reference(tuple(p), NEW) for p in MEDIUM]
    await engine.shutdown()
    assert_invariants(engine)  # replay of the recorded run: preemptions re-derived step by step


def test_block_size_64_pp2_greedy_matches(pp2_block64):
    assert _tokens(pp2_block64, MEDIUM[:4], "b64-") == \
        [greedy_reference(tuple(p), NEW) for p in MEDIUM[:4]]
    _pool_is_whole(pp2_block64)


def test_shared_system_prompt_second_prefill_computes_only_the_suffix(pp2_block64):
    eng = pp2_block64
    a, b = SYSTEM + [11, 12, 13], SYSTEM + [21, 22, 23, 24, 25]
    first = _tokens(eng, [a], "sys-a-")
    before = eng.engine.stats()
    second = _tokens(eng, [b], "sys-b-")
    after = eng.engine.stats()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 192  # 3 x 64
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(b) - 192
    assert first == [greedy_reference(tuple(a), NEW)] and second == [greedy_reference(tuple(b), NEW)]
    _pool_is_whole(eng)


def test_abort_request_holding_shared_prefix_blocks(pp2_block64):
    eng = pp2_block64
    keep, drop = SYSTEM + [31, 32], SYSTEM + [41, 42, 43]
    long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    before = eng.engine.stats()["prefix_cache_hit_tokens"]

    async def go():
        return await asyncio.gather(eng.collect("keep", keep, long),
                                    eng.collect("drop", drop, long, abort_after=2))
    kept, dropped = eng.run(go())
    assert dropped["finish_reason"] == "abort" and 2 <= len(dropped["token_ids"]) < 16
    assert eng.engine.stats()["prefix_cache_hit_tokens"] - before == 2 * 192  # both shared
    assert tuple(kept["token_ids"]) == greedy_reference(tuple(keep), 16)
    _pool_is_whole(eng)
