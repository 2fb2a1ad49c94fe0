"""Dynamic prefill chunk sizing: chunks of equal estimated time as the cached prefix grows.

A chunk of n tokens after a prefix of P cached tokens costs, beyond the step's base cost,
``c * n + d * n * (P + (n - 1) / 2)`` seconds (:meth:`ppstate.step_cost.StepCostModel.chunk_s`:
linear layers + attention over the prefix). With a fixed chunk size the later chunks of a long
prompt take longer and longer, so the stage holding chunk k + 1 is busier than the stage holding
chunk k and the pipeline falls out of step. With ``dynamic_chunks`` each chunk gets the largest n
whose estimated time does not exceed that of a ``max_prefill_chunk`` chunk at prefix 0, solving
the quadratic above for n (SGLang's dynamic chunking for chunked pipeline parallelism predicts
chunk sizes from the same kind of fitted latency curve; vLLM RFC #41685 proposes it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ppstate.step_cost import StepCostModel, model_of

if TYPE_CHECKING:
    from ppstate.budget import SchedulerConfig


def equal_time_chunk(model: StepCostModel, prefix: int, max_chunk: int, min_chunk: int = 1) -> int:
    """Tokens (``min_chunk``..``max_chunk``) of the next chunk after ``prefix`` cached tokens whose
    estimated time equals that of a ``max_chunk`` chunk at prefix 0 (rounded down)."""
    target = model.chunk_s(max_chunk, 0)
    c, d = model.per_token_s, model.per_prefix_token_s
    if d <= 0.0 or prefix <= 0:
        return max_chunk
    # (d / 2) n^2 + (c + d (P - 1/2)) n - target = 0
    b = c + d * (prefix - 0.5)
    n = (-b + math.sqrt(b * b + 2.0 * d * target)) / d
    return max(min_chunk, min(max_chunk, int(n + 1e-9)))


def chunk_limit(config: "SchedulerConfig", prefix: int) -> int:
    """Most tokens the next prefill chunk of a request with ``prefix`` computed tokens may have:
    ``max_prefill_chunk``, or the equal-time size with ``config.dynamic_chunks`` (at least one
    KV block, so a chunk never shrinks below ``block_size`` tokens unless max_prefill_chunk does)."""
    if not config.dynamic_chunks:
        return config.max_prefill_chunk
    floor = min(config.block_size, config.max_prefill_chunk)
    return equal_time_chunk(model_of(config), prefix, config.max_prefill_chunk, floor)
