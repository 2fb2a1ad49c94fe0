"""Which implementation a kernel call runs: Triton or the torch fallback, and how Triton launches.

Backends: ``"triton"`` (one compiled kernel on CUDA; Triton's interpreter for CPU tensors),
``"torch"`` (the vectorised fallback), ``"auto"`` (Triton when the tensors are on CUDA and Triton
imports, or when ``PPSTATE_TRITON_INTERPRET=1`` / ``TRITON_INTERPRET=1`` is set; else torch).

Shared by the model's kernels (:mod:`runtime.model.kernels.attention`,
:mod:`runtime.model.kernels.fused`) and the worker's post-update
(:mod:`runtime.worker.kernels.post_update`). Importing this module does not import Triton.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def _interpret_forced() -> bool:
    return os.environ.get("PPSTATE_TRITON_INTERPRET") == "1" or \
        os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick ``"triton"`` or ``"torch"`` for tensors on ``device``.

    Raises:
        ValueError: unknown ``backend``.
        RuntimeError: ``backend="triton"`` but Triton does not import.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but `import triton` fails")
        return "triton"
    if triton_available() and (device.type == "cuda" or _interpret_forced()):
        return "triton"
    return "torch"


def launch_interpreted(device: torch.device) -> bool:
    """Whether a Triton kernel for tensors on ``device`` runs in Triton's interpreter (CPU
    tensors, or ``PPSTATE_TRITON_INTERPRET=1``) rather than compiled."""
    return device.type != "cuda" or os.environ.get("PPSTATE_TRITON_INTERPRET") == "1"
