"""Llama decoder layer pieces: RMSNorm, GQA attention over the slot KV cache, SwiGLU MLP.

Numerics follow HF ``modeling_llama`` (RMSNorm in fp32, Zhang & Sennrich 2019; SwiGLU, Shazeer 2020;
grouped-query attention, Ainslie et al. 2023). Q/K/V and gate/up projections are fused into one
matmul each. The residual stream is carried separately (vLLM convention): a layer takes
``(hidden, residual)`` and returns the un-added MLP output and the updated residual, so a stage
boundary sends both and the first add of the next stage happens inside its first norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.batch_meta import BatchMeta
from runtime.model.config import ModelConfig
from runtime.model.rope import apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32, result in x.dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta,
           k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its row's cached context.

    Args:
        q: ``[T, H, D]`` rotated queries; k, v: ``[T, KVH, D]`` (k rotated).
        k_cache, v_cache: one layer's cache ``[max_num_reqs, KVH, max_model_len, D]`` (written in place).
    Returns:
        ``[T, H * D]`` attention output (softmax(q k^T / sqrt(D)) v, causal within each row).
    """
    k_cache[meta.token_slots, :, meta.positions] = k
    v_cache[meta.token_slots, :, meta.positions] = v
    t, h, d = q.shape
    out = None if len(meta.groups) == 1 and meta.groups[0].dense else q.new_empty(t, h, d)
    for g in meta.groups:  # at most two groups per step (decode rows; prefill rows)
        rows = g.slots.shape[0]
        qg = q.index_select(0, g.gather).view(rows, g.q_max, h, d).transpose(1, 2)
        kg = k_cache[:, :, :g.kv_len].index_select(0, g.slots)
        vg = v_cache[:, :, :g.kv_len].index_select(0, g.slots)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(rows * g.q_max, h, d)
        if out is None:
            return o.reshape(t, h * d)
        out.index_copy_(0, g.tokens, o.index_select(0, g.padded))
    return out.reshape(t, h * d)


class DecoderLayer(nn.Module):
    """One Llama block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))`` with a carried residual.

    Parameters (no grad): ``ln1, ln2 [H]``; ``qkv [(NH + 2 * KVH) * D, H]``; ``o [H, NH * D]``;
    ``gate_up [2 * I, H]``; ``down [H, I]``.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.ln1, self.ln2 = p(weights["input_layernorm.weight"]), p(weights["post_attention_layernorm.weight"])
        self.qkv = p(torch.cat([weights[f"self_attn.{n}_proj.weight"] for n in "qkv"], 0))
        self.o = p(weights["self_attn.o_proj.weight"])
        self.gate_up = p(torch.cat([weights["mlp.gate_proj.weight"], weights["mlp.up_proj.weight"]], 0))
        self.down = p(weights["mlp.down_proj.weight"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: BatchMeta,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, residual [T, H]`` (residual None: x is the whole stream) -> (mlp_out, residual)."""
        cfg = self.cfg
        residual = x if residual is None else x + residual
        qkv = F.linear(rms_norm(residual, self.ln1, cfg.rms_norm_eps), self.qkv)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        t = x.shape[0]
        q = apply_rope(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        attn = attend(q, k, v.view(t, cfg.num_kv_heads, cfg.head_dim), meta, k_cache, v_cache)
        residual = F.linear(attn, self.o) + residual
        gate, up = F.linear(rms_norm(residual, self.ln2, cfg.rms_norm_eps), self.gate_up).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down), residual
