"""Paged attention kernels (runtime/model/kernels/attention.py) against the torch reference.

CPU: Triton's interpreter at small shapes (fp32). GPU (marked, skipped without CUDA): compiled
kernels in bf16 at model shapes, with split-K. Batches are random: distinct shuffled blocks per
row, decode rows (1 query) mixed with chunk rows (cached prefix + several queries), padding rows
(slot -1, seq_len 0) like a CUDA graph's.
"""

from __future__ import annotations

import pytest
import torch

from runtime.model.kernels.attention import choose_num_splits, paged_attention, write_kv
from runtime.model.kernels.attention_ref import paged_attention_ref, write_kv_ref


def random_batch(g: torch.Generator, *, rows: int, h: int, kvh: int, d: int, block_size: int,
                 max_ctx: int, max_q: int, dtype: torch.dtype, device: str, pad_rows: int = 0):
    """A random paged step. Returns (q, k, v, k_cache, v_cache, slot_mapping, block_tables,
    seq_lens, query_start_loc, max_query_len); the cache already holds every row's prefix."""
    query_lens = [1 if torch.rand(1, generator=g).item() < 0.5 else
             int(torch.randint(1, max_q + 1, (1,), generator=g)) for _ in range(rows)]
    ctxs = [int(torch.randint(0, max_ctx, (1,), generator=g)) for _ in range(rows)]
    mb = max(-(-(c + q) // block_size) for c, q in zip(ctxs, query_lens))
    num_blocks = rows * mb + 3
    perm = torch.randperm(num_blocks, generator=g)
    bt = perm[:rows * mb].view(rows, mb).to(torch.int32)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    k_cache = rnd(num_blocks, block_size, kvh, d)
    v_cache = rnd(num_blocks, block_size, kvh, d)
    slots = []
    for r, (c, q) in enumerate(zip(ctxs, query_lens)):
        pos = torch.arange(c, c + q)
        slots.append(bt[r, pos // block_size].long() * block_size + pos % block_size)
    query_lens += [1] * pad_rows
    seq_lens = [c + q for c, q in zip(ctxs, query_lens)] + [0] * pad_rows
    slots += [torch.full((1,), -1, dtype=torch.long)] * pad_rows
    bt = torch.cat([bt, torch.zeros(pad_rows, mb, dtype=torch.int32)])
    t = sum(query_lens)
    qsl = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    dev = lambda x: x.to(device)  # noqa: E731
    return (dev(rnd(t, h, d)), dev(rnd(t, kvh, d)), dev(rnd(t, kvh, d)), dev(k_cache), dev(v_cache),
            dev(torch.cat(slots)), dev(bt), dev(torch.tensor(seq_lens, dtype=torch.int32)), dev(qsl),
            max(query_lens))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def check_case(seed: int, device: str, dtype: torch.dtype, tol: float, num_splits: int = 1, **shape):
    g = torch.Generator().manual_seed(seed)
    q, k, v, kc, vc, sm, bt, sl, qsl, mq = random_batch(g, dtype=dtype, device=device, **shape)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, sm, backend="triton")
    write_kv_ref(k, v, kc_ref, vc_ref, sm)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)   # bitwise: a copy; -1 untouched
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))                        # poison: every element written
    paged_attention(q, kc, vc, bt, sl, qsl, mq, scale, num_splits=num_splits, out=out,
                    backend="triton")
    ref = paged_attention_ref(q, kc_ref, vc_ref, bt, sl, qsl, scale)
    assert not out.isnan().any()
    assert _rel(out, ref) < tol, (seed, _rel(out, ref))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpreter_mixed_batch_matches_reference(seed, num_splits):
    """Interpreter, fp32: decode + chunk + padding rows, GQA 4:2, block size 4 (tiles span blocks)."""
    check_case(seed, "cpu", torch.float32, 1e-5, num_splits=num_splits, rows=4, h=4, kvh=2, d=16,
               block_size=4, max_ctx=40, max_q=9, pad_rows=1)


def test_write_kv_skips_minus_one_and_rejects_bad_shapes():
    kc = torch.zeros(2, 4, 1, 16)
    vc = torch.zeros(2, 4, 1, 16)
    k = torch.ones(3, 1, 16)
    write_kv(k, 2 * k, kc, vc, torch.tensor([5, -1, 0]), backend="triton")
    assert kc.view(8, 16).sum(1).tolist() == [16, 0, 0, 0, 0, 16, 0, 0]
    assert vc.view(8, 16).sum(1).tolist() == [32, 0, 0, 0, 0, 32, 0, 0]
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="do not match"):
        write_kv(torch.ones(3, 2, 16), torch.ones(3, 2, 16), kc, vc, torch.tensor([0, 1, 2]))


def test_torch_backend_equals_reference_and_split_choice():
    g = torch.Generator().manual_seed(7)
    q, k, v, kc, vc, sm, bt, sl, qsl, mq = random_batch(
        g, rows=3, h=6, kvh=2, d=8, block_size=4, max_ctx=20, max_q=5, dtype=torch.float32,
        device="cpu")
    out = paged_attention(q, kc, vc, bt, sl, qsl, mq, 0.3, backend="torch")
    assert torch.equal(out, paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.3))
    assert choose_num_splits(256, 8, 4096) == 1          # enough programs already
    assert choose_num_splits(1, 8, 4096) == 16           # one long row: split it
    assert choose_num_splits(1, 8, 300) == 1             # short context: not worth it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [dict(h=9, kvh=3, d=64), dict(h=32, kvh=8, d=128)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_bf16_mixed_batches_match_reference(shape, num_splits):
    """Compiled kernels, bf16, SmolLM2 and Llama-3-8B head shapes, block size 16."""
    for seed in range(4):
        check_case(seed, "cuda", torch.bfloat16, 2e-2, num_splits=num_splits, rows=12,
                   block_size=16, max_ctx=700, max_q=70, pad_rows=3, **shape)


def check_fused(device: str, dtype: torch.dtype, t: int, h: int, kvh: int, d: int, n: int, i: int,
                atol: float):
    """Fused kernels (Triton) == their torch fallbacks (the layers' own code)."""
    from runtime.model.kernels.fused import add_rms_norm, rope_write_kv, silu_mul
    from runtime.model.layers import rope_tables
    g = torch.Generator().manual_seed(t)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    x, res, w = rnd(t, n), rnd(t, n), rnd(n)
    for r in (res, None):
        got = add_rms_norm(x, r, w, 1e-5, backend="triton")
        ref = add_rms_norm(x, r, w, 1e-5, backend="torch")
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, atol=atol, rtol=atol)
    gu = rnd(t, 2 * i)
    torch.testing.assert_close(silu_mul(gu, backend="triton"), silu_mul(gu, backend="torch"),
                               atol=atol, rtol=atol)
    cos, sin = (c.to(device, dtype) for c in rope_tables(1.0 / (1e4 ** (torch.arange(0, d, 2) / d)), 64))
    qkv = rnd(t, (h + 2 * kvh) * d)
    pos = torch.randint(0, 64, (t,), generator=g).to(device)
    slots = torch.randperm(4 * 8, generator=g)[:t].to(device)
    slots[0] = -1
    caches = [rnd(4, 8, kvh, d) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q = rope_write_kv(qkv, cos, sin, pos, slots, *caches, h, backend="triton")
    q_ref = rope_write_kv(qkv, cos, sin, pos, slots, *ref_caches, h, backend="torch")
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=atol)
    for c, cr in zip(caches, ref_caches):
        torch.testing.assert_close(c, cr, atol=atol, rtol=atol)


def test_interpreter_fused_kernels_match_torch():
    check_fused("cpu", torch.float32, t=5, h=4, kvh=2, d=16, n=48, i=40, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fused_kernels_match_torch_bf16():
    """bf16 at the SmolLM2 and Llama-3-8B widths: equal up to one bf16 rounding step."""
    check_fused("cuda", torch.bfloat16, t=17, h=9, kvh=3, d=64, n=576, i=1536, atol=1.6e-2)
    check_fused("cuda", torch.bfloat16, t=9, h=32, kvh=8, d=128, n=4096, i=14336, atol=1.6e-2)


def test_interpreter_matches_the_model_reference_of_the_paged_cache():
    """Also against #18's reference (``runtime.model.paged_attention``), the CPU path's own."""
    from runtime.model.paged_attention import paged_attention_reference
    from runtime.model.paged_attention import write_kv as model_write_kv
    g = torch.Generator().manual_seed(11)
    q, k, v, kc, vc, sm, bt, sl, qsl, mq = random_batch(
        g, rows=5, h=6, kvh=2, d=16, block_size=4, max_ctx=30, max_q=7, dtype=torch.float32,
        device="cpu")
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, sm, backend="triton")
    model_write_kv(k, v, kc2, vc2, sm)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    out = paged_attention(q, kc, vc, bt, sl, qsl, mq, 0.25, backend="triton")
    ref = paged_attention_reference(q, kc2, vc2, bt, sl, qsl, mq, 0.25)
    assert _rel(out, ref) < 1e-5
