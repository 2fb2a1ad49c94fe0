"""Decoder layer pieces: RMSNorm, rotary embedding, GQA attention over the paged KV cache, (padded)
linear layers. The layer composed of them is :class:`runtime.model.decoder.DecoderLayer`.

Numerics follow HF ``modeling_llama`` (RMSNorm in fp32, Zhang & Sennrich 2019; SwiGLU, Shazeer 2020;
grouped-query attention, Ainslie et al. 2023). Q/K/V and gate/up projections are fused into one
matmul each. The residual stream is carried separately (vLLM convention): a layer takes
``(hidden, residual)`` and returns the un-added MLP output and the updated residual, so a stage
boundary sends both and the first add of the next stage happens inside its first norm.

Rotary embedding (RoPE, Su et al. 2021) uses the half-split pairing (GPT-NeoX / HF ``rotate_half``);
its frequencies and tables (every rope kind) are in :mod:`runtime.model.rope`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.batch_meta import BatchMeta
from runtime.model.paged_attention import gather_kv, head_major_index, write_kv
from runtime.model.rope import rope_inv_freq, rope_tables  # noqa: F401  (re-exported)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by per-token angles; ``cos``/``sin`` are ``[T, head_dim // 2]``
    already in ``x``'s dtype. Half-split pairing: dim i rotates with dim i + head_dim // 2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32, result in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: torch.Tensor, min_rows: int = 0,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ w[out, in].T (+ bias [out]) -> [T, out]``; with ``T < min_rows`` the input is
    zero-padded to ``min_rows`` rows first (results sliced back).

    Why: CPU sgemm (MKL, one thread) takes a different kernel for fewer than 16 rows, whose
    accumulation order differs; at >= 16 rows a row's result is bitwise independent of the other
    rows (measured, torch 2.13 CPU). Padding thus makes a request's logits independent of batch
    composition and prefill chunking (batch invariance), which the engine relies on when it compares
    schedules token for token. Not guaranteed with several threads (K may be split) or on CUDA.
    """
    n = x.shape[0]
    if n >= min_rows:
        return F.linear(x, w, bias)
    return F.linear(F.pad(x, (0, 0, 0, min_rows - n)), w, bias)[:n]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta,
           k_cache: torch.Tensor, v_cache: torch.Tensor, invariant: bool = True) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend every query to its row's context,
    gathered through the row's block table (``meta.groups[i].kv_index``).

    Args:
        q: ``[T, H, D]`` rotated queries; k, v: ``[T, KVH, D]`` (k rotated).
        k_cache, v_cache: one layer's cache ``[num_blocks, block_size, KVH, D]`` (written in place
            at ``meta.slot_mapping``).
        invariant: explicit-matmul attention (see :func:`_grouped_attention`) instead of
            ``scaled_dot_product_attention``.
    Returns:
        ``[T, H * D]``: softmax(q k^T / sqrt(D)) v, causal within each row, GQA (query head h reads
        KV head ``h // (H / KVH)``, as HF ``repeat_kv``).
    """
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    t, h, d = q.shape
    kvh = k.shape[1]
    out = None if len(meta.groups) == 1 and meta.groups[0].dense else q.new_empty(t, h, d)
    for g in meta.groups:  # at most two groups per step (decode rows; prefill rows)
        rows = g.slots.shape[0]
        qg = q if out is None else q.index_select(0, g.gather)  # dense single group: as laid out
        qg = qg.view(rows, g.q_max, h, d).transpose(1, 2)
        idx = g.memo.get(kvh)
        if idx is None:  # once per step, shared by every layer of the stage
            idx = g.memo[kvh] = head_major_index(g.kv_index, rows, g.kv_len, kvh)
        kg = gather_kv(k_cache, idx, rows, g.kv_len)   # [rows, KVH, kv_len, D]
        vg = gather_kv(v_cache, idx, rows, g.kv_len)
        if invariant:
            o = _grouped_attention(qg, kg, vg, g.mask)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(rows * g.q_max, h, d)
        if out is None:
            return o.reshape(t, h * d)
        out.index_copy_(0, g.tokens, o.index_select(0, g.padded))
    return out.reshape(t, h * d)


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """Attention as two batched matmuls and a softmax (HF "eager" form), with the query heads
    sharing a KV head stacked into one matrix so K/V are never repeated.

    ``q [R, H, Q, D]``, ``k, v [R, KVH, L, D]``, ``mask [R, 1, Q, L]`` bool -> ``[R, H, Q, D]``.
    With L padded to ``KV_ALIGN``, a row's result is bitwise independent of the other rows, of L and
    of Q on the CPU (measured; the flash SDPA CPU kernel is not: its blocking depends on the batch).
    """
    r, h, n, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    scores = torch.matmul(q.reshape(r, kvh, (h // kvh) * n, d), k.transpose(-1, -2)) * d ** -0.5
    scores = scores.view(r, kvh, h // kvh, n, length).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs.view(r, kvh, (h // kvh) * n, length), v).view(r, h, n, d)
