"""Llama decoder layer pieces: RMSNorm, rotary embedding, GQA attention over the paged KV cache,
SwiGLU MLP.

Numerics follow HF ``modeling_llama`` (RMSNorm in fp32, Zhang & Sennrich 2019; SwiGLU, Shazeer 2020;
grouped-query attention, Ainslie et al. 2023). Q/K/V and gate/up projections are fused into one
matmul each. The residual stream is carried separately (vLLM convention): a layer takes
``(hidden, residual)`` and returns the un-added MLP output and the updated residual, so a stage
boundary sends both and the first add of the next stage happens inside its first norm.

Rotary embedding (RoPE, Su et al. 2021) uses the half-split pairing (GPT-NeoX / HF ``rotate_half``):
``inv_freq_i = theta ** (-2i / d)`` with the scalings of transformers' ``modeling_rope_utils``:
``linear`` (every frequency divided by ``factor``) and ``llama3`` (Meta's Llama 3.1 rule: low
frequencies divided by ``factor``, high ones kept, a smooth blend between); llama.cpp's
per-frequency divisors (``rope_freqs.weight``) are accepted too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.batch_meta import BatchMeta
from runtime.model.config import ModelConfig, rope_type
from runtime.model.paged_attention import gather_kv, head_major_index, write_kv


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 (radians per position) for ``cfg``.

    Args:
        freq_factors: optional llama.cpp divisors ``[head_dim // 2]`` applied after scaling.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    kind, sc = rope_type(cfg.rope_scaling), cfg.rope_scaling or {}
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, float(sc["factor"]), float(sc["low_freq_factor"]),
                      float(sc["high_freq_factor"]), float(sc["original_max_position_embeddings"]))
    if freq_factors is not None:
        inv = inv / freq_factors.float()
    return inv


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, old_len: float) -> torch.Tensor:
    """Llama 3.1 frequency rescaling (same formula as transformers ``_compute_llama3_parameters``)."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_len, head_dim // 2]`` fp32 for positions ``0..max_len-1``."""
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    return angles.cos(), angles.sin()


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


def linear(x: torch.Tensor, w: torch.Tensor, min_rows: int = 0) -> torch.Tensor:
    """``x [T, in] @ w[out, in].T -> [T, out]``; with ``T < min_rows`` the input is zero-padded to
    ``min_rows`` rows first (results sliced back).

    Why: CPU sgemm (MKL, one thread) takes a different kernel for fewer than 16 rows, whose
    accumulation order differs; at >= 16 rows a row's result is bitwise independent of the other
    rows (measured, torch 2.13 CPU). Padding thus makes a request's logits independent of batch
    composition and prefill chunking (batch invariance), which the engine relies on when it compares
    schedules token for token. Not guaranteed with several threads (K may be split) or on CUDA.
    """
    n = x.shape[0]
    if n >= min_rows:
        return F.linear(x, w)
    return F.linear(F.pad(x, (0, 0, 0, min_rows - n)), w)[:n]


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


class DecoderLayer(nn.Module):
    """One Llama block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))`` with a carried residual.

    Parameters (no grad): ``ln1, ln2 [H]``; ``qkv [(NH + 2 * KVH) * D, H]``; ``o [H, NH * D]``;
    ``gate_up [2 * I, H]``; ``down [H, I]``. ``min_rows``: see :func:`linear`.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], min_rows: int = 0) -> None:
        super().__init__()
        self.cfg, self.min_rows = cfg, min_rows
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.ln1 = p(weights["input_layernorm.weight"])
        self.ln2 = p(weights["post_attention_layernorm.weight"])
        self.qkv = p(torch.cat([weights[f"self_attn.{n}_proj.weight"] for n in "qkv"], 0))
        self.o = p(weights["self_attn.o_proj.weight"])
        self.gate_up = p(torch.cat([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]], 0))
        self.down = p(weights["mlp.down_proj.weight"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: BatchMeta,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, residual [T, H]`` (residual None: x is the whole stream) -> (mlp_out, residual)."""
        cfg, rows = self.cfg, self.min_rows
        residual = x if residual is None else x + residual
        qkv = linear(rms_norm(residual, self.ln1, cfg.rms_norm_eps), self.qkv, rows)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        t = x.shape[0]
        q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        attn = attend(q, k, v.view(t, cfg.num_kv_heads, cfg.head_dim), meta, k_cache, v_cache,
                      invariant=rows > 0)
        residual = linear(attn, self.o, rows) + residual
        gate, up = linear(rms_norm(residual, self.ln2, cfg.rms_norm_eps), self.gate_up, rows).chunk(2, -1)
        return linear(F.silu(gate) * up, self.down, rows), residual
