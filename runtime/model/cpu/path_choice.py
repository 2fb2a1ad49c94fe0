"""Which CPU path a rank serves with, and the one line rank 0 prints about it on stderr.

The fast path (``docs/cpu_fast_path.md``) serves unless something bypasses it; every bypass is
named, so an operator who sees the slower exact path knows which flag (or which model) chose it:

* ``--cpu-path exact`` (also ``EngineConfig``'s default, which the tests and benchmarks keep);
* ``--tp N`` with N > 1: tensor-parallel ranks run the exact path (``docs/tp.md``);
* ``--spec-tokens K`` with K > 0: speculative decoding keeps the exact path;
* a model the fast path does not implement (``fast_stage.fast_path_unsupported``: a family other
  than Llama / Mistral, or one of their pieces it lacks).

Examples of the line::

    CPU path: fast (ONNX Runtime MatMulNBits: 8-bit weight blocks, int8 activations)
    CPU path: exact (fp32 torch reference; reason: --tp 2, --spec-tokens 2)
"""

from __future__ import annotations

from collections.abc import Callable

#: the line's text for the fast path
FAST = "CPU path: fast (ONNX Runtime MatMulNBits: 8-bit weight blocks, int8 activations)"


def exact_reasons(cpu_path: str, tp_size: int, spec_tokens: int,
                  model_unsupported: Callable[[], str | None]) -> list[str]:
    """Why the fast path is bypassed (empty: it serves).

    Args:
        cpu_path: ``"fast"`` or ``"exact"`` (``--cpu-path``).
        tp_size: tensor-parallel ranks per stage (``--tp``).
        spec_tokens: drafted tokens per step (``--spec-tokens``).
        model_unsupported: returns what of the model the fast path lacks (e.g. ``"family 'qwen2'
            with qkv bias"``) or None; called only when no flag bypasses the path already (it
            opens the checkpoint).
    Returns:
        the reasons in this order: the flags as typed (``--cpu-path exact``, ``--tp 2``,
        ``--spec-tokens 2``), else ``"<model piece> is not implemented by the fast path"``.
    """
    reasons = []
    if cpu_path == "exact":
        reasons.append("--cpu-path exact")
    if tp_size > 1:
        reasons.append(f"--tp {tp_size}")
    if spec_tokens > 0:
        reasons.append(f"--spec-tokens {spec_tokens}")
    if not reasons:
        lacking = model_unsupported()
        if lacking is not None:
            reasons.append(f"{lacking} is not implemented by the fast path")
    return reasons


def cpu_path_line(reasons: list[str]) -> str:
    """The startup line: :data:`FAST` without reasons, else the exact path and its reasons."""
    if not reasons:
        return FAST
    return f"CPU path: exact (fp32 torch reference; reason: {', '.join(reasons)})"
