"""Mixture-of-experts MLP, CPU reference: per-token top-k routing and the experts' SwiGLU MLPs.

Routing (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; Qwen3-MoE) with the roundings of
transformers' implementation: router logits ``x @ W_r^T`` in the model dtype, softmax in fp32,
top-k of the probabilities (``torch.topk``), optionally divided by their sum (renormalised), then
cast back to the model dtype. Each expert e runs ``down_e(silu(gate_e(x)) * up_e(x))`` (gate and
up as one matmul of the stacked ``[2 I, H]`` weight) on the tokens routed to it; a token's output is
the sum of its experts' outputs times their weights, added in ascending expert order (as
transformers' ``index_add_`` loop does). Every matmul is padded to ``min_rows`` rows
(:func:`runtime.model.layers.linear`), so a token's result does not depend on which other tokens
share its experts: the path stays batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.layers import linear


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool,
          min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x [T, H]`` by ``router [E, H]``.

    Returns:
        ``(weights [T, k] in x's dtype, experts [T, k] int64)``; experts in decreasing weight order.
    """
    logits = linear(x, router, min_rows)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def moe_reference(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int, renormalize: bool, min_rows: int = 0) -> torch.Tensor:
    """The MoE MLP of ``x [T, H]``, looping over the experts that received tokens.

    Args:
        router: ``[E, H]``; gate_up: ``[E, 2 I, H]`` (gate rows first); down: ``[E, H, I]``.
    Returns:
        ``[T, H]`` in x's dtype.
    """
    weights, experts = route(x, router, top_k, renormalize, min_rows)
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():    # sorted ascending
        token, slot = torch.where(experts == e)
        h = x.index_select(0, token)
        gate, up = linear(h, gate_up[e], min_rows).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, down[e], min_rows)
        out.index_add_(0, token, y * weights[token, slot, None])
    return out
