"""Copies between host and device that do not stall the step.

Host to device (:func:`to_device`): PyTorch's default (blocking) copy of a CPU tensor to CUDA
synchronises the whole stream after the copy (``memcpy_and_sync``), so every small metadata
upload would wait for the GPU to finish the work already queued -- the previous step included.
:func:`to_device` copies with ``non_blocking=True``: from pageable memory the driver stages the
bytes before the call returns (no device synchronisation), so the source may change right after.

Device to host: pinned memory, ``non_blocking``, an event.

The last rank's sampled ids leave the GPU this way: :meth:`HostCopy.start` enqueues the copy of
the step's payload into page-locked host memory behind the step's kernels and records a CUDA
event after it, and returns at once; the side that talks to the engine calls
:meth:`PendingCopy.wait` (``cudaEventSynchronize``) only when it needs the values, so the host is
free to prepare and launch the next step meanwhile. On the CPU there is nothing to overlap and the
path degenerates to a plain copy.

Pinned buffers come from PyTorch's caching host allocator, which does not hand a block out again
before the copies recorded on it have completed.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(a, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a`` (numpy array, list or CPU tensor; ``[...]``) on ``device`` without a host sync.

    Args:
        a: the values; dtype: cast on the host first (None: keep ``a``'s).
    Returns: a tensor on ``device`` (``a`` itself when it is already there in that dtype).
    """
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device, non_blocking=True)


class PendingCopy:
    """One copy in flight: ``host`` (a pinned tensor on CUDA) is valid once ``event`` completed.

    Attributes:
        host: the destination, same shape and dtype as the source.
        event: CUDA event recorded after the copy, or None on the CPU (already complete).
    """

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.host, self.event = host, event
        self.landed = event is None   # known complete: later checks make no CUDA call

    def ready(self) -> bool:
        """Whether the copy has landed (never blocks)."""
        if not self.landed:
            self.landed = self.event.query()
        return self.landed

    def wait(self) -> np.ndarray:
        """Block until the copy has landed; the values as a numpy array (a view of ``host``).
        A second wait (or one after :meth:`ready` saw it land) makes no CUDA call."""
        if not self.landed:
            self.event.synchronize()
            self.landed = True
        return self.host.numpy()


class HostCopy:
    """Starts device-to-host copies on ``device``'s current stream.

    Args:
        device: where the source tensors live.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self, src: torch.Tensor) -> PendingCopy:
        """Enqueue ``src`` -> host (any shape; ``src`` must stay unchanged until the copy lands,
        which stream order guarantees for values written by earlier kernels of the stream).

        Returns: the pending copy. On the CPU the copy is made now and is complete.
        """
        if src.device.type != "cuda":
            return PendingCopy(src.detach().clone(), None)
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(src.device))
        return PendingCopy(host, event)
