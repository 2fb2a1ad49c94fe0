"""Fused elementwise kernels of the GPU fast path: fewer launches per decoder layer.

A decode step of a small model is launch-bound: ``runtime.model.layers`` spends ~40 kernels per
layer, mostly elementwise (fp32 RMSNorm is 8, the rotary embedding 7 per tensor). These three
Triton kernels replace them (9 launches per layer in all with the GEMMs and the attention):

* :func:`add_rms_norm` -- ``residual = x + residual``; ``out = weight * rms_norm(residual)``.
* :func:`rope_write_kv` -- rotate q and k of the fused QKV output (half-split RoPE), write the
  rotated k and v into the paged cache through ``slot_mapping`` (-1 skipped), return q; with
  ``q_norm`` / ``k_norm`` (Qwen3) each head of q and k is RMS-normalised first, in the same pass.
* :func:`silu_mul` -- ``silu(gate) * up`` of the fused gate/up output.

Numerics follow ``runtime.model.layers`` (fp32 math, the same roundings to the model dtype).
Backends as in :mod:`runtime.model.kernels.attention` (Triton on CUDA, interpreter on CPU when forced,
else a torch fallback that *is* the layers' code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.kernels.attention import _pow2
from runtime.model.kernels.attention_ref import write_kv_ref
from runtime.model.kernels.backend import launch_interpreted, resolve_backend
from runtime.model.layers import apply_rope, rms_norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [T, N]`` (residual None: x is the stream) -> ``(normed [T, N], new residual
    [T, N])``, both in x's dtype. ``weight [N]``; ``eps`` as in the model config."""
    if resolve_backend(backend, x.device) == "torch":
        res = x if residual is None else x + residual
        return rms_norm(res, weight, eps), res
    from runtime.model.kernels._triton_fused import get_kernels
    t, n = x.shape
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    if t:
        x = x.contiguous()
        get_kernels(launch_interpreted(x.device)).add_rms_norm[(t,)](
            x, x if residual is None else residual.contiguous(), weight, out, res_out, eps,
            N=n, BLOCK=_pow2(n), HAS_RES=residual is not None)
    return out, res_out


def rope_write_kv(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                  positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, num_heads: int, backend: str = "auto",
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """Per-head q/k RMSNorm (optional), rotary embedding of q and k, and the KV-cache write.

    Args:
        qkv: ``[T, (H + 2 KVH) * D]`` contiguous fused projection output.
        cos_table, sin_table: ``[max_len, D / 2]`` in qkv's dtype (``layers.rope_tables``).
        positions: ``[T]`` int64; slot_mapping: ``[T]`` int64 flat KV index, -1 = skip.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` (written in place).
        q_norm, k_norm: ``[D]`` RMSNorm weights applied to every head of q / k before RoPE (both
            or neither); eps: their epsilon.
    Returns:
        rotated q ``[T, H, D]``.
    """
    t = qkv.shape[0]
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    h = num_heads
    if resolve_backend(backend, qkv.device) == "torch":
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k = q.reshape(t, h, d), k.reshape(t, kvh, d)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
        cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
        q = apply_rope(q, cos, sin)
        write_kv_ref(apply_rope(k, cos, sin), v.reshape(t, kvh, d), k_cache, v_cache, slot_mapping)
        return q
    from runtime.model.kernels._triton_fused import get_kernels
    q = torch.empty(t, h, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        get_kernels(launch_interpreted(qkv.device)).rope_write_kv[(t,)](
            qkv.contiguous(), cos_table, sin_table, positions, slot_mapping, q, k_cache, v_cache,
            cos_table if q_norm is None else q_norm, cos_table if k_norm is None else k_norm,
            float(eps), H=h, KVH=kvh, HALF=d // 2, BLOCK_H=_pow2(max(h, kvh)),
            BLOCK_HALF=_pow2(d // 2), HAS_NORM=q_norm is not None)
    return q


def silu_mul(gate_up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``gate_up [T, 2 I]`` -> ``silu(gate) * up`` ``[T, I]``."""
    if resolve_backend(backend, gate_up.device) == "torch":
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up
    from runtime.model.kernels._triton_fused import get_kernels
    t, i2 = gate_up.shape
    i = i2 // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, _pow2(i))
        get_kernels(launch_interpreted(gate_up.device)).silu_mul[(t, -(-i // block))](
            gate_up.contiguous(), out, I=i, BLOCK=block)
    return out
