"""Device kernels of the worker: the post-update of the slot-indexed device state (Triton, with a
vectorised torch fallback). The model's kernels are :mod:`runtime.model.kernels`; the backend rule
both follow is :mod:`runtime.model.kernels.backend` (re-exported here).

Importing this package does not import Triton; the Triton kernels are built on first use.
"""

from runtime.model.kernels.backend import BACKENDS, resolve_backend, triton_available
from runtime.worker.kernels.post_update import post_update_computed, post_update_sampled

__all__ = ["BACKENDS", "post_update_computed", "post_update_sampled", "resolve_backend",
           "triton_available"]
