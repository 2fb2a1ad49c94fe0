"""Tensor parallelism inside pipeline stages (issue #35), real worker processes over gloo.

Two engines, each shared by its tests (module fixtures):

* TP=2 x PP=1 on a Qwen3-MoE (8 experts, 2 per token, q/k norms) with ONE KV head (replicated on
  both TP ranks) and a vocabulary of 509 (the second vocab shard is zero-padded): every expert's
  intermediate dimension split across the TP ranks; prefill chunks of 8 tokens, a KV budget small
  enough to preempt, prefix-cache hits;
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
    # 40KB per rank = 10 blocks of 16 tokens (1 local KV head x 16 x 2 layers x fp32): the eight
    # 12-16 token prompts fit admitted, not decoded past 16 tokens, so requests are preempted
    eng = _engine(kv1[0], pp_size=1, kv_cache_memory="40KB")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tp2pp2(kv2):
    eng = _engine(kv2[0], pp_size=2, mode="overlapped")
    yield eng
    eng.close()


def test_tp2_greedy_equals_transformers_with_chunked_prefill_and_preemption(tp2, kv1):
    prompts = _prompts(8, 12, 16, 509, seed=1)   # two chunks of 8 each
    got = [tuple(r["token_ids"]) for r in tp2.generate(prompts, GREEDY)]
    stats = tp2.engine.stats()
    assert stats["kv_blocks_total"] == 10 and stats["num_preemptions"] > 0
    assert (stats["pp_size"], stats["tp_size"], len(stats["rank_busy_seconds"])) == (1, 2, 2)
    assert all(b > 0 for b in stats["rank_busy_seconds"])   # both TP ranks computed
    assert got == generate_reference(kv1[1], prompts, NEW)


def test_tp2_prefix_cache_hit_keeps_the_tokens(tp2, kv1):
    shared = _prompts(1, 32, 32, 509, seed=5)[0]          # two full blocks
    a, b = shared + [7, 8, 9], shared + [11, 12]
    first = tp2.generate([a], GREEDY, prefix="pa-")[0]
    before = tp2.engine.stats()["prefix_cache_hit_tokens"]
    second = tp2.generate([b], GREEDY, prefix="pb-")[0]
    assert tp2.engine.stats()["prefix_cache_hit_tokens"] - before == 32
    assert [tuple(first["token_ids"]), tuple(second["token_ids"])] == \
        generate_reference(kv1[1], [a, b], NEW)


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


def test_tp2_token_ids_diverging_on_one_tp_rank_are_named(tp2):
    """Runs last on the TP=2 x PP=1 engine: it kills it. A wrong token id on one TP rank is seen
    by the TP ranks' per-slot digests of ``all_token_ids`` (runtime/worker/tp_check.py) and by that
    rank's own token mirror (runtime/worker/token_check.py), whichever runs first."""
    from runtime import transport as tp
    eng = tp2.engine
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)

    async def go():
        sent = False
        async for out in eng.add_request("victim-ids", [100, 200, 300, 400], params):
            if not sent and out.new_token_ids:
                slot = eng.sched.slots.lookup("victim-ids")
                eng.pool.send_control(1, tp.ControlMsg(kind="corrupt_state", rank=1, slot=slot,
                                                       field="all_token_ids", delta=1))
                sent = True
            if out.finished:
                return out, slot
        return None, None

    last, slot = tp2.run(go(), timeout=60)
    # Two checks can see it first in the same step: the TP ranks' digest comparison
    # (TPDivergence) or tp rank 1's own token mirror (MirrorDivergence, issue #27); both name
    # pp rank 0, tp rank 1, the slot and all_token_ids.
    assert last is not None and last.error is not None
    err = last.error
    if "TPDivergence" in err:
        assert f"tp rank 1 holds other all_token_ids than tp rank 0 for slot {slot}" in err
    else:
        assert "MirrorDivergence: pp rank 0, tp rank 1:" in err
        assert "mirror all_token_ids" in err and f"of slot {slot} " in err
    assert "pp rank 0" in err and not eng.is_alive


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


# ---- no processes: the shard layout, the torchrun world ----------------------------------------
def test_shards_of_every_tensor_reassemble_the_checkpoint(kv1):
    """Concatenating the TP ranks' slices (KV heads de-duplicated, vocab padding dropped, the O
    bias summed) gives back every tensor of the stage, for a 1-KV-head MoE at TP=2 and TP=4."""
    import torch

    from runtime.model.hf_loader import HFCheckpoint
    from runtime.model.tensor_names import EMBED, LM_HEAD, stage_tensor_names
    from runtime.model.tp.shard import TPShardPlan
    ckpt = HFCheckpoint(kv1[0])
    cfg = ckpt.config
    for tp in (2, 4):
        plans = [TPShardPlan(cfg, r, tp) for r in range(tp)]
        assert [p.local_config().num_kv_heads for p in plans] == [1] * tp
        for name in stage_tensor_names(cfg, (0, cfg.num_layers)):
            full, span = ckpt.read(name), plans[0].span(name)
            parts = [p.read(ckpt, name) for p in plans]
            if span is None:
                assert all(torch.equal(x, full) for x in parts), name
                continue
            dim = span[0]
            if name in (EMBED, LM_HEAD):
                parts[-1] = parts[-1][:cfg.vocab_size - plans[-1].vocab_start]
            uniq = []
            for p, x in zip(plans, parts):   # replicated KV heads: keep each slice once
                if p.span(name)[1:] not in [q.span(name)[1:] for q in plans[:plans.index(p)]]:
                    uniq.append(x)
            assert torch.equal(torch.cat(uniq, dim), full), name


def test_tp_refuses_a_degree_the_heads_cannot_split(kv1):
    from runtime.model.hf_loader import HFCheckpoint
    from runtime.model.tp.shard import check_tp
    cfg = HFCheckpoint(kv1[0]).config        # 4 heads, 1 KV head, intermediate 96, experts' 32
    with pytest.raises(ValueError) as exc:
        check_tp(cfg, 3)
    assert str(exc.value) == ("--tp 3: the model has 4 attention heads and 1 KV heads; --tp must "
                              "divide the 4 attention heads and divide the expert intermediate "
                              "size 32 (valid, with the MLP intermediate size 96, expert "
                              "intermediate size 32 split too: 1, 2, 4)")


def test_torchrun_world_is_pp_times_tp():
    from runtime.engine.torchrun import resolve_cli
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "0"}
    assert resolve_cli({"launcher": "auto", "pp_size": None, "tp_size": 2}, env)["pp_size"] == 2
    with pytest.raises(ValueError, match="--pp: pp x tp must equal"):
        resolve_cli({"launcher": "auto", "pp_size": 4, "tp_size": 2}, env)


def _mesh_rank(rank: int, port: int, out) -> None:
    """One of 4 processes (PP=2 x TP=2): build the groups, report what each one holds."""
    import torch
    import torch.distributed as dist

    from runtime.worker.groups import destroy_groups
    from runtime.worker.tp_groups import init_tp_groups
    torch.set_num_threads(1)
    g = init_tp_groups(rank, 2, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 20.0)
    x = torch.tensor([10 ** rank])
    dist.all_reduce(x, group=g.tp_group)
    out.put((rank, g.rank, g.tp_rank, g.chain, g.mesh.mesh_dim_names,
             dist.get_process_group_ranks(g.tp_group), dist.get_process_group_ranks(g.pp_group),
             dist.get_process_group_ranks(g.bcast_group), int(x), g.bcast_group is not g.pp_group))
    destroy_groups(g)


def test_tp_groups_come_from_a_pp_tp_device_mesh():
    """4 gloo processes: the TP group is ``mesh["tp"]`` (a stage's consecutive ranks, an
    all-reduce sums exactly their values), the PP chain ``mesh["pp"]``, the sibling broadcast group
    the same ranks as a second group."""
    import multiprocessing as mp

    from runtime.worker.tp_groups import layout
    assert layout(2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), random.Random().randrange(30000, 40000)
    procs = [ctx.Process(target=_mesh_rank, args=(r, port, out)) for r in range(4)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * 4
    assert got == [
        (0, 0, 0, (0, 2), ("pp", "tp"), [0, 1], [0, 2], [0, 2], 11, True),
        (1, 0, 1, (1, 3), ("pp", "tp"), [0, 1], [1, 3], [1, 3], 11, True),
        (2, 1, 0, (0, 2), ("pp", "tp"), [2, 3], [0, 2], [0, 2], 1100, True),
        (3, 1, 1, (1, 3), ("pp", "tp"), [2, 3], [1, 3], [1, 3], 1100, True)]
