"""The decoder layer, composed from the pieces a family declares (``runtime/model/families``):
attention with optional q/k/v and o biases and optional per-head q/k RMSNorm (Qwen3), then a
dense SwiGLU MLP or a mixture-of-experts MLP (:mod:`runtime.model.moe`).

Numerics follow transformers' Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral layers (RMSNorm in fp32,
Zhang & Sennrich 2019; SwiGLU, Shazeer 2020; grouped-query attention, Ainslie et al. 2023). Q/K/V
and gate/up projections are fused into one matmul each (biases concatenated likewise). The residual
stream is carried separately (vLLM convention): a layer takes ``(hidden, residual)`` and returns the
un-added MLP output and the updated residual, so a stage boundary sends both and the first add of
the next stage happens inside its first norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.model.batch_meta import BatchMeta
from runtime.model.config import ModelConfig
from runtime.model.layers import apply_rope, attend, linear, rms_norm
from runtime.model.moe import moe_reference


class DecoderLayer(nn.Module):
    """One decoder block: ``x + attn(norm(x))`` then ``+ mlp(norm(.))`` with a carried residual.

    Parameters (no grad): ``ln1, ln2 [H]``; ``qkv [(NH + 2 * KVH) * D, H]``, ``qkv_bias`` (or None)
    ``[(NH + 2 * KVH) * D]``; ``o [H, NH * D]``, ``o_bias`` (or None) ``[H]``; ``q_norm, k_norm``
    (or None) ``[D]``. Dense layers: ``gate_up [2 * I, H]``, ``down [H, I]``. MoE layers
    (``self.moe``): ``router [E, H]``, ``experts_gate_up [E, 2 * I_e, H]``, ``experts_down
    [E, H, I_e]``. ``min_rows``: see :func:`runtime.model.layers.linear`.

    Args:
        weights: this layer's tensors by canonical suffix (``tensor_names.layer_suffixes``).
        layer: the layer's index in the whole model (decides dense vs MoE).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], min_rows: int = 0,
                 layer: int = 0) -> None:
        super().__init__()
        self.cfg, self.min_rows, self.moe = cfg, min_rows, cfg.is_moe_layer(layer)
        p = lambda t: None if t is None else nn.Parameter(t, requires_grad=False)  # noqa: E731
        w = weights.get
        self.ln1 = p(w("input_layernorm.weight"))
        self.ln2 = p(w("post_attention_layernorm.weight"))
        self.qkv = p(torch.cat([w(f"self_attn.{n}_proj.weight") for n in "qkv"], 0))
        self.qkv_bias = p(torch.cat([w(f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
                          if cfg.qkv_bias else None)
        self.o = p(w("self_attn.o_proj.weight"))
        self.o_bias = p(w("self_attn.o_proj.bias") if cfg.o_bias else None)
        self.q_norm = p(w("self_attn.q_norm.weight") if cfg.qk_norm else None)
        self.k_norm = p(w("self_attn.k_norm.weight") if cfg.qk_norm else None)
        if self.moe:
            self.router = p(w("mlp.gate.weight"))
            self.experts_gate_up = p(torch.cat([w("mlp.experts.gate_proj"), w("mlp.experts.up_proj")], 1))
            self.experts_down = p(w("mlp.experts.down_proj"))
        else:
            self.gate_up = p(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], 0))
            self.down = p(w("mlp.down_proj.weight"))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: BatchMeta,
                cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x, residual [T, H]`` (residual None: x is the whole stream) -> (mlp_out, residual)."""
        cfg, rows = self.cfg, self.min_rows
        residual = x if residual is None else x + residual
        qkv = linear(rms_norm(residual, self.ln1, cfg.rms_norm_eps), self.qkv, rows, self.qkv_bias)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        t = x.shape[0]
        q, k = q.reshape(t, cfg.num_heads, cfg.head_dim), k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, cfg.rms_norm_eps), rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = attend(q, k, v.reshape(t, cfg.num_kv_heads, cfg.head_dim), meta, k_cache, v_cache,
                      invariant=rows > 0)
        residual = self.reduce(linear(attn, self.o, rows, self.o_bias)) + residual
        return self.reduce(self.mlp(rms_norm(residual, self.ln2, cfg.rms_norm_eps))), residual

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the partial output ``x [T, H]`` of a row-parallel projection (O, down) over the
        tensor-parallel group; the identity without TP (:mod:`runtime.model.tp.stage`)."""
        return x

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of normed ``x [T, H]`` -> ``[T, H]`` (dense SwiGLU or MoE)."""
        cfg, rows = self.cfg, self.min_rows
        if self.moe:
            return moe_reference(x, self.router, self.experts_gate_up, self.experts_down,
                                 cfg.experts_per_token, cfg.moe_renormalize, rows)
        gate, up = linear(x, self.gate_up, rows).chunk(2, -1)
        return linear(F.silu(gate) * up, self.down, rows)
