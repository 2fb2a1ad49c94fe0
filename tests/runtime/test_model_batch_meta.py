"""BatchMeta (per-step attention metadata) exact values, attention against a per-row reference on
random weights, and StageModel input validation. No real model needed: fast."""

from __future__ import annotations

import pytest
import torch

from runtime.model.batch_meta import KV_ALIGN, BatchMeta
from runtime.model.config import ModelConfig
from runtime.model.layers import attend, linear
from runtime.model.paged_attention import paged_attention_reference
from runtime.model.stage import StageModel
from runtime.model.tensor_names import stage_tensor_names, expected_shape


def test_build_exact_values():
    # rows: slot 4 decodes at 9; slot 0 prefills 3 from 0; slot 2 decodes at 20; slot 1 chunk 2 at 5
    meta = BatchMeta.build(torch.tensor([4, 0, 2, 1]), torch.tensor([9, 0, 20, 5]),
                           torch.tensor([1, 3, 1, 2]))
    assert meta.num_tokens == 7 and meta.num_rows == 4 and meta.max_context == 21
    assert meta.positions.tolist() == [9, 0, 1, 2, 20, 5, 6]
    assert meta.token_slots.tolist() == [4, 0, 0, 0, 2, 1, 1]
    assert meta.last_token.tolist() == [0, 3, 4, 6]
    assert meta.slot_bounds == (0, 4)
    decode, prefill = meta.groups
    assert decode.slots.tolist() == [4, 2] and decode.q_max == 1 and decode.kv_len == 32
    assert decode.gather.tolist() == [0, 4] and decode.tokens.tolist() == [0, 4] and decode.dense
    assert decode.mask.shape == (2, 1, 1, 32)
    assert decode.mask[0, 0, 0].nonzero()[:, 0].tolist() == list(range(10))
    assert decode.mask[1, 0, 0].nonzero()[:, 0].tolist() == list(range(21))
    assert prefill.slots.tolist() == [0, 1] and prefill.q_max == 3 and prefill.kv_len == KV_ALIGN
    assert prefill.gather.tolist() == [1, 2, 3, 5, 6, 6]  # row 2's pad repeats its last token
    assert prefill.tokens.tolist() == [1, 2, 3, 5, 6] and prefill.padded.tolist() == [0, 1, 2, 3, 4]
    assert not prefill.dense
    assert prefill.mask[1, 0].sum(-1).tolist() == [6, 7, 7]  # keys 0..5, 0..6, pad as last
    assert prefill.mask[0, 0].sum(-1).tolist() == [1, 2, 3]


def test_build_paged_fields_through_a_block_table():
    # block_size 4; slot 0 -> blocks [7, 2], slot 1 -> [5, 0, 3]
    table = torch.tensor([[7, 2, 0], [5, 0, 3]])
    meta = BatchMeta.build([1, 0], [9, 2], [1, 3], block_table=table, block_size=4)
    assert meta.slot_mapping.tolist() == [3 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0]
    assert meta.block_tables.tolist() == [[5, 0, 3], [7, 2, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.seq_lens.tolist() == [10, 5]
    assert meta.query_start_loc.tolist() == [0, 1, 4]
    assert (meta.max_query_len, meta.max_seq_len, meta.block_bounds) == (3, 10, (0, 7))
    decode = meta.groups[0]
    assert decode.kv_index.tolist()[:12] == [20, 21, 22, 23, 0, 1, 2, 3, 12, 13, 14, 15]
    with pytest.raises(ValueError, match="needs 4 blocks of 4; the block table holds 3"):
        BatchMeta.build([0], [12], [1], block_table=table, block_size=4)


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="R >= 1"):
        BatchMeta.build(torch.tensor([], dtype=torch.long), torch.tensor([]), torch.tensor([]))
    with pytest.raises(ValueError, match="equal length"):
        BatchMeta.build([0, 1], [0], [1])
    with pytest.raises(ValueError, match="query_lens must be >= 1"):
        BatchMeta.build([0], [0], [0])


def reference_attention(q, k, v):
    """Plain causal GQA attention of one row: q [Q, H, D] over k, v [L, KVH, D] (last Q keys new)."""
    h, kvh = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    start = k.shape[0] - q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).reshape(q.shape[0], -1)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("invariant", [True, False], ids=["matmul", "sdpa"])
def test_attend_mixed_batch_matches_per_row_reference(invariant, block_size):
    g = torch.Generator().manual_seed(0)
    slots, starts, query_lens = [3, 0, 5, 1], [7, 0, 30, 4], [1, 6, 1, 9]
    width = -(-48 // block_size)
    table = torch.randperm(6 * width, generator=g).view(6, width)  # scattered blocks per slot
    k_cache, v_cache = (torch.randn(6 * width, block_size, 2, 8, generator=g) for _ in range(2))
    history_k, history_v = k_cache.clone(), v_cache.clone()

    def rows_of(cache, s, a, b):  # positions [a, b) of slot s through its block table
        pos = torch.arange(a, b)
        return cache.view(-1, 2, 8)[table[s][pos // block_size] * block_size + pos % block_size]
    t = sum(query_lens)
    q, k, v = (torch.randn(t, n, 8, generator=g) for n in (6, 2, 2))
    meta = BatchMeta.build(slots, starts, query_lens, block_table=table, block_size=block_size)
    out = attend(q, k, v, meta, k_cache, v_cache, invariant)
    ref = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.max_query_len, 8 ** -0.5)
    torch.testing.assert_close(out, ref.reshape(t, -1), atol=1e-5, rtol=0)
    off = 0
    for s, p, n in zip(slots, starts, query_lens):
        keys = torch.cat([rows_of(history_k, s, 0, p), k[off:off + n]])
        vals = torch.cat([rows_of(history_v, s, 0, p), v[off:off + n]])
        torch.testing.assert_close(out[off:off + n].double(), reference_attention(q[off:off + n], keys, vals),
                                   atol=1e-5, rtol=0)
        assert torch.equal(rows_of(k_cache, s, p, p + n), k[off:off + n])  # written in place
        off += n


def test_linear_padding_keeps_values():
    x, w = torch.randn(5, 12), torch.randn(7, 12)
    torch.testing.assert_close(linear(x, w, 16), x @ w.T, atol=1e-5, rtol=0)
    assert linear(x, w, 16).shape == (5, 7)


def tiny_stage(rng=(0, 2), **kw) -> StageModel:
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=4, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(expected_shape(cfg, n), generator=g) for n in stage_tensor_names(cfg, rng)}
    return StageModel(cfg, rng, weights, max_num_reqs=2, max_model_len=20, dtype=torch.float32,
                      device="cpu", **kw)


def test_stage_validates_inputs():
    first, last = tiny_stage((0, 1)), tiny_stage((1, 2))
    assert first.kv_cache.shape == (1, 2, 4, 16, 2, 4)  # 2 slots x ceil(20 / 16) blocks
    meta = BatchMeta.build([1], [0], [3])
    with pytest.raises(ValueError, match="needs input_ids"):
        first(meta, hidden=torch.zeros(3, 16))
    with pytest.raises(ValueError, match="needs hidden"):
        last(meta, input_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_model_len 20"):
        first(BatchMeta.build([1], [18], [3]), input_ids=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot out of range"):
        first(BatchMeta.build([2], [0], [3]), input_ids=torch.zeros(3, dtype=torch.long))
    hidden, residual = first(meta, input_ids=torch.tensor([1, 2, 3]))
    assert hidden.shape == residual.shape == (3, 16)
    assert last(meta, hidden=hidden, residual=residual).shape == (1, 32)


@pytest.mark.parametrize("invariant", [True, False])
def test_bfloat16_stage_tracks_float32(invariant):
    cfg, g = tiny_stage().cfg, torch.Generator().manual_seed(0)
    weights = {n: torch.randn(expected_shape(cfg, n), generator=g) * (1.0 if "norm" in n else 0.3)
               for n in stage_tensor_names(cfg, (0, 2))}
    meta, ids = BatchMeta.build([0, 1], [0, 0], [5, 3]), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    stages = [StageModel(cfg, (0, 2), weights, max_num_reqs=2, max_model_len=20, dtype=dt,
                         device="cpu", batch_invariant=invariant) for dt in (torch.float32, torch.bfloat16)]
    assert stages[1].kv_cache.dtype == torch.bfloat16 and stages[1].layers[0].qkv.dtype == torch.bfloat16
    ref, got = (st(meta, input_ids=ids) for st in stages)
    assert got.dtype == torch.float32 and got.shape == (2, 32)
    assert ((got - ref).norm() / ref.norm()).item() < 0.03  # bf16 weights alone cost ~1% here
