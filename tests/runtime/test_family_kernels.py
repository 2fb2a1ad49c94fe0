"""Fast-path pieces of the model families on the CPU: the fused q/k norm + RoPE + KV write under
the Triton interpreter against the torch fallback, the loop-free MoE (gathered batched matmul) against
the CPU reference, and the paged fast-path stage of every family against transformers (torch
fallbacks and, for the MoE family, every Triton kernel under the interpreter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from families import build_family_model
from runtime.model.kernels.fused import rope_write_kv
from runtime.model.kernels.moe import moe_forward
from runtime.model.moe import moe_reference
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.model.rope import rope_tables
from runtime.model.stage import load_stage


def test_interpreter_qk_norm_rope_write_kv_matches_torch():
    g = torch.Generator().manual_seed(4)
    t, h, kvh, d = 6, 4, 2, 16
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    qn, kn = torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5
    cos, sin = rope_tables(1.0 / (1e4 ** (torch.arange(0, d, 2) / d)), 64)
    pos = torch.randint(0, 64, (t,), generator=g)
    slots = torch.randperm(32, generator=g)[:t]
    slots[0] = -1
    caches = [torch.randn(4, 8, kvh, d, generator=g) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q = rope_write_kv(qkv, cos, sin, pos, slots, *caches, h, backend="triton", q_norm=qn,
                      k_norm=kn, eps=1e-6)
    q_ref = rope_write_kv(qkv, cos, sin, pos, slots, *ref_caches, h, backend="torch", q_norm=qn,
                          k_norm=kn, eps=1e-6)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    for c, cr in zip(caches, ref_caches):
        torch.testing.assert_close(c, cr, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(q, rope_write_kv(qkv, cos, sin, pos, slots, *ref_caches, h,
                                               backend="torch"))  # the norm changes q


@pytest.mark.parametrize("renormalize", [False, True])
def test_loop_free_moe_matches_reference(renormalize):
    g = torch.Generator().manual_seed(5)
    t, hid, e, i, k = 37, 32, 8, 24, 2
    x = torch.randn(t, hid, generator=g)
    router = torch.randn(e, hid, generator=g)
    gate_up, down = torch.randn(e, 2 * i, hid, generator=g) * 0.2, torch.randn(e, hid, i, generator=g) * 0.2
    ref = moe_reference(x, router, gate_up, down, k, renormalize)
    got = moe_forward(x, router, gate_up, down, k, renormalize, impl="gather")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="grouped_mm"):
        moe_forward(x, router, gate_up, down, k, renormalize, impl="grouped_mm")


@pytest.mark.parametrize("family,kernels", [("qwen2", "torch"), ("qwen3", "torch"),
                                            ("mixtral", "torch"), ("qwen3_moe", "triton-interpreter")])
def test_paged_fast_path_stage_matches_transformers(family, kernels, tmp_path, monkeypatch):
    """Prefill of 2 rows (shuffled blocks of 4 tokens) + 2 decode steps == HF logits (fp32)."""
    if kernels == "triton-interpreter":
        monkeypatch.setenv("PPSTATE_TRITON_INTERPRET", "1")
    hf = build_family_model(family, tmp_path, layers=2)
    stage = load_stage(tmp_path, (0, 2), max_num_reqs=1, max_model_len=16, progress=False,
                       batch_invariant=False, block_size=4, num_blocks=1)
    model = PagedStage(stage, num_blocks=16, max_model_len=32)
    bt = np.random.default_rng(0).permutation(16)[:10].reshape(2, 5)
    ids = torch.randint(2, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    dev = torch.device("cpu")
    logits = model.forward(PagedMeta.build(bt, [0] * 2, [9] * 2, 4, dev, 2), input_ids=ids.reshape(-1))
    for step in range(3):
        with torch.no_grad():
            ref = hf(ids).logits[:, -1].float()
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        nxt = logits.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        logits = model.forward(PagedMeta.build(bt, [9 + step] * 2, [1] * 2, 4, dev, 2), input_ids=nxt)
