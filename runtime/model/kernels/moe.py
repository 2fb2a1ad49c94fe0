"""Mixture-of-experts MLP of the GPU fast path: route, group the (token, expert) pairs by expert,
two grouped GEMMs with the fused SiLU * up between them, weighted combine. No Python loop over
experts, no host synchronisation and no data-dependent shape (every size is fixed by the token
count), so a decode step that contains it can be captured in a CUDA graph.

Grouped GEMM: ``torch._grouped_mm`` (CUTLASS grouped GEMM; bf16 on compute capability >= 9.0,
e.g. H100 / H200) over the pairs sorted by expert, with the per-expert end offsets computed on the
device (``scatter_add_`` + ``cumsum``; ``torch.bincount`` would synchronise). Elsewhere (CPU, fp32,
older GPUs) a gathered batched matmul with the same contract runs instead (each pair multiplies its
expert's weight, gathered: memory ``T * k * 2 I * H``, for tests and small models).

Routing is :func:`runtime.model.moe.route` (transformers' roundings). The combine sums a token's
``k`` expert outputs times their weights in fp32 and rounds once to the model dtype (the CPU
reference adds them in the model dtype in expert order: equal up to rounding).
"""

from __future__ import annotations

import torch

from runtime.model.kernels.fused import silu_mul
from runtime.model.moe import route

IMPLS = ("auto", "grouped_mm", "gather")


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x``: CUDA, bf16, compute capability >= 9.0."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def moe_forward(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_k: int, renormalize: bool, impl: str = "auto") -> torch.Tensor:
    """The MoE MLP of normed ``x [T, H]`` -> ``[T, H]`` (x's dtype).

    Args:
        router: ``[E, H]``; gate_up: ``[E, 2 I, H]`` (gate rows first); down: ``[E, H, I]``.
        impl: ``grouped_mm``, ``gather`` or ``auto`` (grouped_mm where available).
    Raises:
        ValueError: unknown ``impl``, or ``grouped_mm`` where it is not available.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    grouped = grouped_mm_available(x)
    if impl == "grouped_mm" and not grouped:
        raise ValueError("impl='grouped_mm' needs CUDA, bf16 and compute capability >= 9.0")
    t, h = x.shape
    weights, experts = route(x, router, top_k, renormalize)      # [T, k], [T, k]
    flat = experts.reshape(-1)                                    # [T * k]
    order = torch.argsort(flat, stable=True)                      # pairs grouped by expert
    xs = x.index_select(0, order // top_k)                        # [T * k, H]
    if grouped and impl != "gather":
        e = router.shape[0]
        counts = torch.zeros(e, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)               # [E] end offset of each expert
        act = silu_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs))
        ys = torch._grouped_mm(act, down.transpose(1, 2), offs=offs)   # [T * k, H]
    else:
        sorted_experts = flat.index_select(0, order)
        gu = torch.bmm(gate_up.index_select(0, sorted_experts), xs[:, :, None])[..., 0]
        act = silu_mul(gu)
        ys = torch.bmm(down.index_select(0, sorted_experts), act[:, :, None])[..., 0]
    y = torch.empty_like(ys).index_copy_(0, order, ys)            # back to (token, slot) order
    return (y.view(t, top_k, h).float() * weights[..., None].float()).sum(1).to(x.dtype)
