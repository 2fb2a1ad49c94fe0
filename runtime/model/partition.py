"""How the decoder layers are cut into pipeline stages.

The cost model counts multiply-accumulates per decoded token (the steady state the pipeline must
balance): each layer does its projection matmuls (Q, K, V, O, gate, up, down) plus attention over a
typical context (QK^T and PV: ``2 * num_heads * head_dim * context``); the last stage also runs the
final RMSNorm, the LM head (``vocab * hidden``) and sampling (a few passes over the vocabulary).
For SmolLM2-135M the LM head costs about 8 layers, so PP=2 balances at 19/11 rather than 15/15.
"""

from __future__ import annotations

import math

from runtime.model.config import ModelConfig
from runtime.model.errors import PartitionError

FLAG = "--pp-layer-partition"
TYPICAL_CONTEXT = 256       # tokens of context assumed for the attention term
SAMPLING_PASSES = 4         # element passes over the vocabulary per sampled row (softmax, top-k/p)


def layer_cost(cfg: ModelConfig, context: int = TYPICAL_CONTEXT) -> float:
    """MACs per token of one decoder layer: projections + attention over ``context`` tokens."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return float(proj + mlp + 2 * cfg.num_heads * d * context)


def last_stage_extra_cost(cfg: ModelConfig) -> float:
    """MACs per token the last stage adds: final norm, LM head and sampling."""
    return float(cfg.hidden_size + cfg.vocab_size * cfg.hidden_size + SAMPLING_PASSES * cfg.vocab_size)


def split_layers(num_layers: int, pp_size: int, cfg: ModelConfig, context: int = TYPICAL_CONTEXT,
                 *, measured: tuple[float, float] | None = None) -> list[tuple[int, int]]:
    """Cut ``num_layers`` into ``pp_size`` contiguous ``(start, end)`` ranges minimising the largest
    stage cost (:func:`layer_cost` per layer, plus :func:`last_stage_extra_cost` on the last stage).

    The last stage's layer count is searched exhaustively; the other stages split the rest as
    evenly as possible (earlier stages take the remainder). Ties prefer more layers on the last stage.

    Args:
        measured: optional ``(seconds per layer, seconds of the last stage's extra work)`` measured
            on the target machine; replaces the MAC model (which ignores attention overheads and
            GEMM efficiency: on the 2-core CPU the LM head measures ~4 layers, not ~7.4).
    Raises:
        PartitionError: ``pp_size < 1`` or more stages than layers.
    """
    if pp_size < 1 or pp_size > num_layers:
        raise PartitionError(f"cannot split {num_layers} layers into {pp_size} stages")
    if pp_size == 1:
        return [(0, num_layers)]
    per_layer, extra = measured or (layer_cost(cfg, context), last_stage_extra_cost(cfg))
    best: tuple[float, int] | None = None
    for n_last in range(1, num_layers - pp_size + 2):
        rest = math.ceil((num_layers - n_last) / (pp_size - 1)) * per_layer
        cost = max(rest, n_last * per_layer + extra)
        if best is None or cost <= best[0]:
            best = (cost, n_last)
    n_last = best[1]
    q, r = divmod(num_layers - n_last, pp_size - 1)
    return _ranges([q + (i < r) for i in range(pp_size - 1)] + [n_last])


def parse_partition(spec: str, num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Validate a manual ``--pp-layer-partition`` value such as ``"19,11"`` into layer ranges.

    Raises:
        PartitionError: not comma-separated integers, wrong number of stages, a stage with fewer
            than one layer, or a sum other than ``num_layers`` (the message names the flag).
    """
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise PartitionError(f"{FLAG} {spec!r}: expected comma-separated layer counts, "
                             f"e.g. '19,11'") from None
    if len(counts) != pp_size:
        raise PartitionError(f"{FLAG} {spec!r} has {len(counts)} stages but pp_size is {pp_size}")
    if min(counts) < 1:
        raise PartitionError(f"{FLAG} {spec!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise PartitionError(f"{FLAG} {spec!r} sums to {sum(counts)} layers; the model has {num_layers}")
    return _ranges(counts)


def resolve_partition(cfg: ModelConfig, pp_size: int, spec: str | None = None) -> list[tuple[int, int]]:
    """``parse_partition(spec)`` when a manual value is given, else :func:`split_layers`."""
    if spec:
        return parse_partition(spec, cfg.num_layers, pp_size)
    return split_layers(cfg.num_layers, pp_size, cfg)


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    """Layer counts -> contiguous ``(start, end)`` ranges."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out
