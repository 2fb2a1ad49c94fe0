"""GPU fast path of the model families (CUDA only; skipped without a device): the grouped-GEMM MoE
against the gathered form and the CPU reference's numerics, the fused q/k norm + RoPE + KV write
compiled in bf16, and a Qwen3-MoE-shaped stage with CUDA graphs against eager and transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.bench.gpu_models import hf_model, model_config, random_stage
from runtime.model.kernels.moe import grouped_mm_available, moe_forward
from runtime.model.moe import moe_reference
from runtime.model.paged_stage import PagedStage

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NEAR_TIE = 0.05   # logits (bf16 random weights); a differing id must be within this of the top


def assert_greedy_close(ours: list[int], ref: list[int], ref_scores: torch.Tensor) -> int:
    """Equal ids up to the first difference, which must be a near-tie of the reference's scores;
    returns the number of ids equal before it."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            margin = float(ref_scores[i, b] - ref_scores[i, a])
            assert margin < NEAR_TIE, f"step {i}: {a} != {b}, reference margin {margin:.4f}"
            return i
    return len(ours)


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_moe_grouped_mm_matches_gather_and_reference(tokens):
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(tokens)
    e, h, i, k = 16, 256, 128, 4
    rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=g, device=dev) * sc).bfloat16()  # noqa: E731
    x, router = rnd(tokens, h), rnd(e, h, sc=0.2)
    gate_up, down = rnd(e, 2 * i, h, sc=0.06), rnd(e, h, i, sc=0.08)
    ref = moe_reference(x.float(), router.float(), gate_up.float(), down.float(), k, True)
    gathered = moe_forward(x, router, gate_up, down, k, True, impl="gather")
    torch.testing.assert_close(gathered.float(), ref, atol=3e-2, rtol=3e-2)
    if grouped_mm_available(x):
        grouped = moe_forward(x, router, gate_up, down, k, True, impl="grouped_mm")
        torch.testing.assert_close(grouped.float(), gathered.float(), atol=2e-2, rtol=2e-2)


def test_cuda_qk_norm_rope_write_kv_matches_torch_bf16():
    from runtime.model.kernels.fused import rope_write_kv
    from runtime.model.rope import rope_tables
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(2)
    t, h, kvh, d = 33, 32, 4, 128
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, torch.bfloat16)  # noqa: E731
    qkv, qn, kn = rnd(t, (h + 2 * kvh) * d) * 4, rnd(d).abs() + 0.5, rnd(d).abs() + 0.5
    cos, sin = (c.to(dev, torch.bfloat16) for c in rope_tables(1.0 / (1e6 ** (torch.arange(0, d, 2) / d)), 256))
    pos = torch.randint(0, 256, (t,), generator=g).to(dev)
    slots = torch.randperm(64 * 16, generator=g)[:t].to(dev)
    caches = [rnd(64, 16, kvh, d) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    kw = dict(q_norm=qn, k_norm=kn, eps=1e-6)
    q = rope_write_kv(qkv, cos, sin, pos, slots, *caches, h, backend="triton", **kw)
    q_ref = rope_write_kv(qkv, cos, sin, pos, slots, *ref_caches, h, backend="torch", **kw)
    torch.testing.assert_close(q, q_ref, atol=3e-2, rtol=2e-2)
    for c, cr in zip(caches, ref_caches):
        torch.testing.assert_close(c, cr, atol=3e-2, rtol=2e-2)


def test_moe_stage_graphs_equal_eager_and_close_to_transformers():
    from runtime.bench.gpu_decode import GreedyLoop, make_lane
    from runtime.bench.gpu_hf import greedy_ids
    from runtime.worker.cuda_graphs import DecodeGraphs
    dev = torch.device("cuda", 0)
    shape, plen, new, rows = "tiny-qwen3-moe", 16, 16, 5
    model = PagedStage(random_stage(shape, None, dev), num_blocks=64, max_model_len=64)
    graphs = DecodeGraphs(model, 8, 4, 64)
    graphs.capture(progress=False)
    prompts = np.random.default_rng(0).integers(2, model_config(shape).vocab_size - 1, (rows, plen))
    outs = {}
    for name, gr in (("graphs", graphs), ("eager", None)):
        loop = GreedyLoop(model, gr)
        lane = make_lane(rows, 3, 0, dev, seed=1)
        loop.prefill(lane, prompts)
        first = lane.ids.cpu()
        loop.decode(lane, new - 1, keep_tokens=True)
        outs[name] = torch.stack([first] + lane.tokens, 1).tolist()
    assert outs["graphs"] == outs["eager"]
    hf = hf_model(shape, dev)
    matched = 0
    for r in range(rows):
        ref, scores = greedy_ids(hf, torch.as_tensor(prompts[r], device=dev), new)
        matched += assert_greedy_close(outs["graphs"][r], ref.tolist(), scores.cpu())
    assert matched >= rows * new // 2
