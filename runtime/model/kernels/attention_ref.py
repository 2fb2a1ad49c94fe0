"""Plain torch reference of the paged-KV attention contract (tests and CPU fallback of
:mod:`runtime.model.kernels.attention`).

Same contract as the Triton kernels: ``write_kv`` stores each token's key/value at the flat cache
index ``slot_mapping[t]`` (``-1`` skipped); ``paged_attention`` lets query i of row r (``query_len``
queries, ``seq_len`` keys) attend keys ``0 .. seq_len - query_len + i`` of that row, gathered through
its block table, GQA by ``h // (H // KVH)``. Computed row by row in fp32 (an explicit-matmul
softmax, HF "eager" form): slow and simple on purpose.
"""

from __future__ import annotations

import torch


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """``k, v [T, KVH, D]`` into ``k_cache, v_cache [num_blocks, block_size, KVH, D]`` at flat
    token index ``slot_mapping [T]`` (int; ``-1`` = skip). In place."""
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[idx] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[idx] = v[keep].to(v_cache.dtype)


def gather_row_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` tokens of one row: ``[seq_len, KVH, D]`` read through its block table
    (``cache [num_blocks, block_size, KVH, D]``, ``block_table_row [MB]`` int)."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    return cache[block_table_row.long()[pos // bs], pos % bs]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q [T, H, D]`` over the paged cache; returns ``[T, H, D]`` in
    ``q.dtype`` (rows with ``seq_len`` 0 get zeros). Shapes as in
    :mod:`runtime.model.kernels.attention`."""
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        a, b = qsl[r], qsl[r + 1]
        if b == a or seq_len == 0:
            continue
        k = gather_row_kv(k_cache, block_tables[r], seq_len).float()        # [L, KVH, D]
        v = gather_row_kv(v_cache, block_tables[r], seq_len).float()
        k = k.repeat_interleave(h // kvh, dim=1).transpose(0, 1)              # [H, L, D]
        v = v.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        qr = q[a:b].float().transpose(0, 1)                                   # [H, Q, D]
        scores = qr @ k.transpose(1, 2) * scale                               # [H, Q, L]
        qpos = seq_len - (b - a) + torch.arange(b - a, device=q.device)
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[a:b] = (torch.softmax(scores, -1) @ v).transpose(0, 1).to(q.dtype)
    return out
