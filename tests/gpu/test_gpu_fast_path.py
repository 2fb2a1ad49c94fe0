"""GPU fast path end to end: paged stage + CUDA graphs, PP=2 over NCCL, side-stream broadcast.

CPU part (always runs): the paged stage over the torch reference kernels equals transformers on a
tiny random model, and the decode-graph bucket sizes. GPU part (marked, skipped without CUDA; two
GPUs for PP=2): greedy ids of graphs on / off and of PP=2 (sync and overlapped) against
transformers / PP=1, with a tolerance only on near-ties; the side-stream broadcast keeps its
order over 1,000 steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.bench.gpu_models import hf_model, model_config, random_stage
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.worker.cuda_graphs import bucket_sizes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
NEAR_TIE = 0.05   # logits (bf16 random weights); a differing id must be within this of the top


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("kernels", ["torch", "triton-interpreter"])
def test_paged_stage_matches_transformers_on_cpu(kernels, monkeypatch):
    """Prefill of 3 rows (shuffled blocks of 4 tokens) + 3 decode steps == HF logits (fp32), with
    the torch fallbacks and with every Triton kernel under the interpreter."""
    if kernels == "triton-interpreter":
        monkeypatch.setenv("PPSTATE_TRITON_INTERPRET", "1")
    dev = torch.device("cpu")
    stage = random_stage("tiny", None, dev, torch.float32, block_size=4)
    hf = hf_model("tiny", dev, torch.float32)
    model = PagedStage(stage, num_blocks=24, max_model_len=64)
    bt = np.random.default_rng(0).permutation(24)[:18].reshape(3, 6)
    ids = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(0))
    logits = model.forward(PagedMeta.build(bt, [0] * 3, [9] * 3, 4, dev, 2), input_ids=ids.reshape(-1))
    for step in range(4):
        ref = hf(ids).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        nxt = logits.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        logits = model.forward(PagedMeta.build(bt, [9 + step] * 3, [1] * 3, 4, dev, 2), input_ids=nxt)


def assert_greedy_close(ours: list[int], ref: list[int], ref_scores: torch.Tensor | None = None):
    """Equal ids up to the first difference; that one must be a near-tie in the reference's
    scores (when given), after which sequences legitimately diverge."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert ref_scores is not None, f"step {i}: {a} != {b}"
            margin = float(ref_scores[i, b] - ref_scores[i, a])
            assert margin < NEAR_TIE, f"step {i}: {a} != {b}, reference margin {margin:.4f}"
            return i
    return len(ours)


@pytest.mark.gpu
@cuda
def test_graphs_on_off_and_transformers_agree():
    from runtime.bench.gpu_decode import GreedyLoop, make_lane
    from runtime.bench.gpu_hf import greedy_ids
    from runtime.worker.cuda_graphs import DecodeGraphs
    dev = torch.device("cuda", 0)
    shape, plen, new, rows = "smollm2-135m", 16, 24, 5
    vocab = model_config(shape).vocab_size
    model = PagedStage(random_stage(shape, None, dev), num_blocks=64, max_model_len=64)
    graphs = DecodeGraphs(model, 8, 4, 64)
    graphs.capture(progress=False)
    prompts = np.random.default_rng(0).integers(100, vocab - 1, (rows, plen))
    outs = {}
    for name, g in (("graphs", graphs), ("eager", None)):
        loop = GreedyLoop(model, g)
        lane = make_lane(rows, 3, 0, dev, seed=1)
        loop.prefill(lane, prompts)
        first = lane.ids.cpu()
        loop.decode(lane, new - 1, keep_tokens=True)
        outs[name] = torch.stack([first] + lane.tokens, 1).tolist()       # [rows, new]
    hf = hf_model(shape, dev)
    matched = []
    for r in range(rows):
        ref, scores = greedy_ids(hf, torch.as_tensor(prompts[r], device=dev), new)
        for name in outs:
            matched.append(assert_greedy_close(outs[name][r], ref.tolist(), scores.cpu()))
    assert sum(matched) >= rows * new   # at least half the ids matched before any near-tie


@pytest.mark.gpu
@cuda
@two_gpus
def test_pp2_nccl_sync_equals_pp1_and_overlapped_close_and_broadcast_order():
    from runtime.bench.gpu_decode import GreedyLoop, make_lane
    from runtime.bench.gpu_pp import run_pp2
    from runtime.worker.cuda_graphs import DecodeGraphs
    shape, batch, plen, new = "smollm2-135m", 8, 16, 20
    jobs = [{"kind": "decode", "mode": m, "batch": batch, "plen": plen, "new": new,
             "keep_tokens": True} for m in ("sync", "overlapped")]
    jobs.append({"kind": "order", "steps": 1000})
    got = run_pp2(shape, jobs, port=29631)[1]["results"]
    dev = torch.device("cuda", 0)
    vocab = model_config(shape).vocab_size
    max_len = plen + new + 17                           # as gpu_pp.pp_worker sizes it
    model = PagedStage(random_stage(shape, None, dev), num_blocks=64, max_model_len=max_len)
    graphs = DecodeGraphs(model, batch, -(-max_len // 16), max_len)
    graphs.capture(progress=False)
    prompts = np.random.default_rng(1).integers(100, vocab - 1, (batch, plen))

    def pp1(rows: np.ndarray) -> list[list[int]]:
        loop = GreedyLoop(model, graphs)
        lane = make_lane(len(rows), -(-(plen + new) // 16), 0, dev)
        loop.prefill(lane, prompts[rows])
        first = lane.ids.cpu()
        loop.decode(lane, new - 1, keep_tokens=True)
        return torch.stack([first] + lane.tokens, 1).tolist()

    # Same kernels on the same shapes give the same bits on either GPU: sync PP=2 (one lane of 8
    # rows) equals PP=1 at batch 8, overlapped PP=2 (two lanes of 4) equals PP=1 per lane.
    assert got[0]["tokens"] == pp1(np.arange(batch))
    assert got[1]["tokens"] == pp1(np.arange(batch // 2)) + pp1(np.arange(batch // 2, batch))
    assert got[2]["wrong_steps"] == 0


def test_batch_meta_without_groups_keeps_the_paged_fields():
    """The fast path skips the CPU attention groups; every paged field stays as built with them
    and the block bounds are those of the blocks the rows really read (mixed decode and chunk
    rows, shuffled table; the CPU path also reads padded, masked key positions)."""
    from runtime.model.batch_meta import BatchMeta
    rng = np.random.default_rng(3)
    table = torch.from_numpy(rng.permutation(40 * 8).reshape(40, 8).astype(np.int32))
    slots, starts = rng.permutation(40)[:9], rng.integers(0, 90, 9)
    query_lens = np.where(rng.random(9) < 0.5, 1, rng.integers(1, 30, 9))
    a = BatchMeta.build(slots, starts, query_lens, "cpu", table, 16)
    b = BatchMeta.build(slots, starts, query_lens, "cpu", table, 16, attention_groups=False)
    read = np.concatenate([table[s, :-(-(st + q) // 16)].numpy()
                           for s, st, q in zip(slots, starts, query_lens)])
    assert b.groups == () and b.block_bounds == (int(read.min()), int(read.max()))
    assert a.block_bounds[0] <= b.block_bounds[0] and b.block_bounds[1] <= a.block_bounds[1]
    for f in ("positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc", "last_token"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
