"""The device rule, in one place: which device a ``--device`` value means on this machine.

Used by the engine process before any worker starts (:func:`runtime.engine.plan.check_resources`)
and by every worker when it picks its device (:func:`runtime.worker.main.pick_device`).
"""

from __future__ import annotations


def uses_cuda(device: str) -> bool:
    """True for ``cuda``, and for ``auto`` when torch sees a CUDA device; False for ``cpu``.

    Raises:
        ValueError: ``cuda`` asked for but torch sees no CUDA device (names ``--device``).
    """
    if device == "cpu":
        return False
    import torch  # only here: the engine's config and CLI code import no torch
    if torch.cuda.is_available():
        return True
    if device == "cuda":
        raise ValueError("--device: cuda was asked for but torch sees no CUDA device "
                         f"(torch {torch.__version__})")
    return False
