"""Paged KV cache on the CPU: the write through ``slot_mapping``, the key gather through the block
table, and a plain per-row reference of the kernel interface agreed with the GPU kernels.

Cache layout per layer: ``k_cache, v_cache [num_blocks, block_size, KVH, D]`` (vLLM's flash layout);
token position p of a row lives at flat index ``block_tables[r, p // block_size] * block_size +
p % block_size``. The functions here are exact torch code; the Triton kernels are tested against
:func:`paged_attention_reference`.
"""

from __future__ import annotations

import torch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values into the paged cache (in place).

    Args:
        k, v: ``[T, KVH, D]``.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``.
        slot_mapping: ``[T]`` long flat index ``block * block_size + offset``; ``-1`` rows skipped.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, head_index: torch.Tensor, rows: int, kv_len: int) -> torch.Tensor:
    """Keys (or values) of ``rows`` rows, laid out ``[rows, KVH, kv_len, D]`` contiguous (the layout
    the old slot cache gave, so the matmuls that follow are unchanged), in one gather of D-vectors.

    Args:
        cache: ``[num_blocks, block_size, KVH, D]``.
        head_index: ``[rows * KVH * kv_len]`` long, from :func:`head_major_index`.
    """
    kvh, d = cache.shape[2], cache.shape[3]
    return cache.view(-1, d).index_select(0, head_index).view(rows, kvh, kv_len, d)


def head_major_index(kv_index: torch.Tensor, rows: int, kv_len: int, kvh: int) -> torch.Tensor:
    """Index into the ``[num_blocks * block_size * KVH, D]`` view of (row, head, position), head
    major: ``kv_index [rows * kv_len]`` (token cells) -> ``[rows * KVH * kv_len]``."""
    heads = torch.arange(kvh, device=kv_index.device)
    return (kv_index.view(rows, 1, kv_len) * kvh + heads.view(1, kvh, 1)).reshape(-1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start_loc: torch.Tensor, max_query_len: int,
                              scale: float) -> torch.Tensor:
    """Causal GQA attention of a flat batch over the paged cache, one row at a time (fp32 math).

    Args:
        q: ``[T, H, D]``; k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``.
        block_tables: ``[R, MB]`` int; seq_lens: ``[R]`` context after this step;
        query_start_loc: ``[R + 1]``; max_query_len: unused here (kernel launch size);
        scale: softmax scale (``D ** -0.5``).
    Returns:
        ``[T, H, D]`` in q's dtype: query i of row r (absolute position ``seq_lens[r] - query_len + i``)
        attends keys ``0 .. position``; query head h reads KV head ``h // (H // KVH)``.
    """
    del max_query_len
    out = torch.empty_like(q)
    bs, (h, kvh) = k_cache.shape[1], (q.shape[1], k_cache.shape[2])
    for r in range(block_tables.shape[0]):
        a, b, n = int(query_start_loc[r]), int(query_start_loc[r + 1]), int(seq_lens[r])
        pos = torch.arange(n, device=q.device)
        idx = block_tables[r].long()[pos // bs] * bs + pos % bs
        k = k_cache.view(-1, kvh, k_cache.shape[3]).index_select(0, idx).float()
        v = v_cache.view(-1, kvh, v_cache.shape[3]).index_select(0, idx).float()
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].float(), k) * scale
        qpos = n - (b - a) + torch.arange(b - a, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
