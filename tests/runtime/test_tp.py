"""Tensor parallelism inside pipeline stages (issue #35), real worker processes over gloo.

Two engines, each shared by its tests (module fixtures):

* TP=2 x PP=1 on a Qwen3-MoE (8 experts, 2 per token, q/k norms) with ONE KV head (replicated on
  both TP ranks) and a vocabulary of 509 (the second vocab shard is zero-padded): every expert's
  intermediate dimension split across the TP ranks; prefill chunks of 8 tokens;
* TP=2 x PP=2, overlapped schedule, on a Qwen2 (q/k/v biases) with two KV heads (one per TP
  rank): hidden states go stage 0 TP r -> stage 1 TP r, the sampled ids come back on each TP
  rank's chain.

Greedy ids equal transformers' ``generate`` token for token; mirrors are validated after every step
on every rank; a corrupted device field on TP rank 1 of stage 1 stops the engine with an error
naming pp rank, tp rank, step, slot and field.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine_harness import EngineThread
from families import build_family_model, generate_reference
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]


def _engine(folder, **kw) -> EngineThread:
    base = dict(model=str(folder), max_num_seqs=8, max_model_len=128, max_prefill_chunk=8,
                max_num_batched_tokens=32, step_timeout_s=30.0, tp_size=2, device="cpu")
    return EngineThread(EngineConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def kv1(tmp_path_factory):
    """(folder, transformers model): Qwen3-MoE, 2 layers, 1 KV head, vocabulary 509."""
    folder = tmp_path_factory.mktemp("tp-kv1")
    return folder, build_family_model("qwen3_moe", folder, layers=2, num_key_value_heads=1,
                                      vocab_size=509)


@pytest.fixture(scope="module")
def kv2(tmp_path_factory):
    """(folder, transformers model): Qwen2 (q/k/v biases), 2 layers, 2 KV heads, vocabulary 512."""
    folder = tmp_path_factory.mktemp("tp-kv2")
    return folder, build_family_model("qwen2", folder, layers=2)


@pytest.fixture(scope="module")
def tp2(kv1):
    eng = _engine(kv1[0], pp_size=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tp2pp2(kv2):
    eng = _engine(kv2[0], pp_size=2, mode="overlapped")
    yield eng
    eng.close()


def test_tp2_greedy_equals_transformers_with_chunked_prefill(tp2, kv1):
    prompts = _prompts(5, 3, 30, 509, seed=1)   # up to 4 chunks of 8
    got = [tuple(r["token_ids"]) for r in tp2.generate(prompts, GREEDY)]
    assert got == generate_reference(kv1[1], prompts, NEW)


def test_tp2_abort_mid_decode_then_serves_the_rest(tp2, kv1):
    eng = tp2.engine
    prompts = _prompts(3, 4, 12, 509, seed=2)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def go():
        victim = tp2.collect("victim", prompts[0], long, abort_after=3)
        others = [tp2.collect(f"o{i}", p, GREEDY) for i, p in enumerate(prompts[1:])]
        return await asyncio.gather(victim, *others)

    victim, *others = tp2.run(go())
    assert victim["finish_reason"] == "abort" and 3 <= len(victim["token_ids"]) < 40
    want = generate_reference(kv1[1], prompts, 3)
    assert tuple(victim["token_ids"][:3]) == want[0]
    assert [tuple(o["token_ids"]) for o in others] == generate_reference(kv1[1], prompts[1:], NEW)
    after = tp2.generate([prompts[0]], GREEDY, prefix="after-")[0]   # the freed slot serves again
    assert tuple(after["token_ids"]) == generate_reference(kv1[1], prompts[:1], NEW)[0]
    sched = eng.sched
    assert sched.slots.num_free == sched.config.max_num_seqs
    assert sched.num_running == 0 and sched.num_waiting == 0


def test_tp2_pp2_overlapped_greedy_equals_transformers(tp2pp2, kv2):
    prompts = _prompts(6, 3, 28, 512, seed=3)
    got = [tuple(r["token_ids"]) for r in tp2pp2.generate(prompts, GREEDY)]
    assert got == generate_reference(kv2[1], prompts, NEW)


def test_tp2_pp2_divergence_on_one_tp_rank_is_named(tp2pp2):
    """Runs last on this engine: it kills it. Global rank 3 = stage 1, TP rank 1."""
    from runtime import transport as tp
    eng = tp2pp2.engine
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def go():
        sent = False
        async for out in eng.add_request("victim", [100, 200, 300, 400], params):
            if not sent and out.new_token_ids:
                slot = eng.sched.slots.lookup("victim")
                eng.pool.send_control(3, tp.ControlMsg(kind="corrupt_state", rank=3, slot=slot,
                                                       field="num_computed_tokens", delta=3))
                sent = True
            if out.finished:
                return out
        return None

    last = tp2pp2.run(go(), timeout=60)
    assert last is not None and last.error is not None
    assert "pp rank 1, tp rank 1" in last.error and "MirrorDivergence" in last.error
    assert "num_computed_tokens" in last.error and "slot" in last.error and "step" in last.error
    assert not eng.is_alive and "rank 3" in eng.error
