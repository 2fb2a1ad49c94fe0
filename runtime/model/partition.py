"""How the decoder layers are cut into pipeline stages.

The cost model counts multiply-accumulates per decoded token (the steady state the pipeline must
balance): each layer does its projection matmuls (Q, K, V, O, and gate, up, down of a dense MLP)
plus attention over a typical context (QK^T and PV: ``2 * num_heads * head_dim * context``); an
MoE layer (Qwen3-MoE, Mixtral) instead does its router (``experts * hidden``), a few passes over the
router scores (softmax, top-k) and the MLPs of the ``experts_per_token`` experts it activates, not of
all experts. The last stage also runs the final RMSNorm, the LM head (``vocab * hidden``: Qwen's
151,936-token head weighs about 5 Qwen3-30B-A3B layers) and sampling (a few passes over the
vocabulary); the first stage gathers embedding rows (``hidden`` per token, negligible in time: the
embedding weighs on the first rank's memory, which its KV-cache sizing accounts for, not on its
step time). For SmolLM2-135M the LM head costs about 8 layers, so PP=2 balances at 19/11 rather
than 15/15. Models whose layers differ in cost (dense and MoE layers mixed) are cut by a dynamic
program over contiguous ranges.
"""

from __future__ import annotations

import math

from runtime.model.config import ModelConfig
from runtime.model.errors import PartitionError

FLAG = "--pp-layer-partition"
TYPICAL_CONTEXT = 256       # tokens of context assumed for the attention term
SAMPLING_PASSES = 4         # element passes over the vocabulary per sampled row (softmax, top-k/p)
ROUTING_PASSES = 4          # element passes over the router scores per token (softmax, top-k, sort)


def layer_cost(cfg: ModelConfig, context: int = TYPICAL_CONTEXT, layer: int = 0) -> float:
    """MACs per token of decoder layer ``layer``: projections + attention over ``context`` tokens
    + its MLP (dense, or the MoE router, routing and the active experts' MLPs)."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    if cfg.is_moe_layer(layer):
        e = cfg.num_experts
        mlp = e * h + ROUTING_PASSES * e + cfg.experts_per_token * 3 * h * cfg.moe_intermediate_size
    else:
        mlp = 3 * h * cfg.intermediate_size
    return float(proj + mlp + 2 * cfg.num_heads * d * context)


def first_stage_extra_cost(cfg: ModelConfig) -> float:
    """MACs-equivalent per token the first stage adds: the embedding row gather (``hidden``)."""
    return float(cfg.hidden_size)


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
    costs = [layer_cost(cfg, context, i) for i in range(num_layers)]
    if measured is None and len(set(costs)) > 1:
        return _split_by_costs(costs, pp_size, first_stage_extra_cost(cfg), last_stage_extra_cost(cfg))
    per_layer, extra = measured or (costs[0], last_stage_extra_cost(cfg))
    best: tuple[float, int] | None = None
    for n_last in range(1, num_layers - pp_size + 2):
        rest = math.ceil((num_layers - n_last) / (pp_size - 1)) * per_layer
        cost = max(rest, n_last * per_layer + extra)
        if best is None or cost <= best[0]:
            best = (cost, n_last)
    n_last = best[1]
    q, r = divmod(num_layers - n_last, pp_size - 1)
    return _ranges([q + (i < r) for i in range(pp_size - 1)] + [n_last])


def _split_by_costs(costs: list[float], pp_size: int, first_extra: float,
                    last_extra: float) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest stage cost for per-layer ``costs`` (dynamic
    program over the end of each stage; ties keep the earliest cut)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage(a: int, b: int, k: int) -> float:
        return (prefix[b] - prefix[a] + (first_extra if k == 0 else 0.0)
                + (last_extra if k == pp_size - 1 else 0.0))

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp_size + 1)]   # best[k][b]: k stages over layers [0, b)
    cut = [[0] * (n + 1) for _ in range(pp_size + 1)]
    best[0][0] = 0.0
    for k in range(1, pp_size + 1):
        for b in range(k, n - (pp_size - k) + 1):
            for a in range(k - 1, b):
                c = max(best[k - 1][a], stage(a, b, k - 1))
                if c < best[k][b]:
                    best[k][b], cut[k][b] = c, a
    ends, b = [], n
    for k in range(pp_size, 0, -1):
        ends.append(b)
        b = cut[k][b]
    ends.reverse()
    return _ranges([e - s for s, e in zip([0] + ends[:-1], ends)])


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
