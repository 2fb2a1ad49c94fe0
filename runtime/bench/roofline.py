"""Decode-step roofline of the GPU benchmark: bytes of weights a step reads / HBM bandwidth.

A decode step of B rows reads every dense weight once (attention projections, norms, dense MLPs,
the LM head) and B rows of the embedding; an MoE layer reads its router and only the experts that
at least one of the B tokens routes to. With routing spread evenly over E experts, k per token, the
expected number of distinct experts a step touches is ``E * (1 - (1 - k / E) ** B)`` (8 of 128 at
B = 1, all 128 from B of about 128 on). The KV cache reads are left out (they grow with context).
Bandwidth: 4.3 TB/s, the H200's HBM3e figure used throughout ``docs/gpu.md``.
"""

from __future__ import annotations

from runtime.model.config import ModelConfig

HBM_BYTES_PER_S = 4.3e12


def experts_touched(cfg: ModelConfig, batch: int) -> float:
    """Expected distinct experts per MoE layer read by a step of ``batch`` tokens (even routing)."""
    e, k = cfg.num_experts, cfg.experts_per_token
    return e * (1.0 - (1.0 - k / e) ** batch) if e else 0.0


def step_weight_bytes(cfg: ModelConfig, batch: int, itemsize: int = 2) -> float:
    """Bytes of weights one decode step of ``batch`` rows reads (model dtype of ``itemsize``)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 2 * h
    attn += (cfg.num_heads + 2 * cfg.num_kv_heads) * d * cfg.qkv_bias + 2 * d * cfg.qk_norm
    params = 0.0
    for layer in range(cfg.num_layers):
        params += attn
        if cfg.is_moe_layer(layer):
            params += cfg.num_experts * h + experts_touched(cfg, batch) * 3 * h * cfg.moe_intermediate_size
        else:
            params += 3 * h * cfg.intermediate_size
    params += cfg.vocab_size * h + h + batch * h      # LM head, final norm, embedding rows
    return params * itemsize


def roofline_step_s(cfg: ModelConfig, batch: int, itemsize: int = 2) -> float:
    """Seconds of a decode step at the HBM roofline: :func:`step_weight_bytes` / 4.3 TB/s."""
    return step_weight_bytes(cfg, batch, itemsize) / HBM_BYTES_PER_S
