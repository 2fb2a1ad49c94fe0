"""Device kernels the model runs (paged attention, fused norm / RoPE / SiLU; Triton, each with a
torch fallback), and the backend rule every kernel of the runtime follows
(:mod:`runtime.model.kernels.backend`).

Importing this package does not import Triton; the Triton kernels are built on first use. The
post-update kernel, which writes the worker's device state, lives with the worker
(:mod:`runtime.worker.kernels`).
"""
