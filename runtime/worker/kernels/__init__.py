"""Device kernels (Triton, each with a vectorised torch fallback).

Importing this package does not import Triton; the Triton kernels are built on first use.
"""

from runtime.worker.kernels.post_update import (
    BACKENDS,
    post_update_computed,
    post_update_sampled,
    resolve_backend,
    triton_available,
)

__all__ = ["BACKENDS", "post_update_computed", "post_update_sampled", "resolve_backend",
           "triton_available"]
