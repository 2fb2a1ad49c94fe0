"""How the Triton kernel modules wrap their bodies: compiled (``triton.jit``) for CUDA tensors, or
Triton's interpreter for CPU tensors (tests and CI without a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import triton


def kernel_wrapper(interpret: bool) -> Callable:
    """``triton.jit``, or ``InterpretedFunction`` when ``interpret`` (runs on CPU tensors)."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction
    return triton.jit
