"""The GPU fast path (:class:`~runtime.model.paged_stage.PagedStage`: Triton paged attention, fused
kernels, CUDA graphs) over one TP rank's slice of a stage (docs/tp.md).

The slice's local config already has the rank's head counts (``NH / tp`` query heads,
``max(KVH / tp, 1)`` KV heads, ``I / tp`` intermediate), so the kernels run unchanged on it: the
fused QKV GEMM produces the rank's heads, ``rope_write_kv`` writes the rank's KV heads into its own
(smaller) paged cache, attention reads them. Only the three hooks of ``PagedStage`` change, as in
the reference :class:`~runtime.model.tp.stage.TPStageModel`:

* ``embed``: vocab-parallel lookup (zeros outside the rank's shard) and an all-reduce;
* ``reduce``: the all-reduce after the O projection and after the MLP (dense or MoE);
* ``logits``: the rank's ``[R, Vp]`` logits, all-gathered to ``[R, V]``.

Every collective goes through :attr:`TPPagedStage.collectives`, normally the stage's
:class:`~runtime.model.tp.comm.TPComm`. While :class:`runtime.worker.tp_graphs.PiecewiseDecodeGraphs`
captures a decode step it is a recorder instead, which ends the CUDA graph being captured at each
collective (a gloo collective cannot be captured) and starts the next one after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.paged_stage import PagedStage
from runtime.model.tp.stage import TPStageModel


class TPPagedStage(PagedStage):
    """:class:`PagedStage` over a :class:`TPStageModel` (one TP rank's slice).

    Args:
        stage: the rank's loaded slice (its ``comm`` is the TP group). Other arguments as
            :class:`PagedStage`.
    Attributes:
        collectives: what runs the collectives: an object with ``all_reduce(x) -> x'`` (sum over
            the TP group, same shape) and ``all_gather_cols(x) -> [R, tp * C]``; the stage's
            ``comm`` unless a piecewise capture has swapped in its recorder.
    """

    def __init__(self, stage: TPStageModel, num_blocks: int | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(stage, num_blocks, max_model_len)
        self.plan, self.comm = stage.plan, stage.comm
        self.collectives = stage.comm
        self.vocab_size = stage.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: ``[T]`` ids -> ``[T, H]``, summed over the TP group (no host
        sync: capturable)."""
        start, rows = self.plan.vocab_start, self.plan.vocab_rows
        local = input_ids - start
        inside = (local >= 0) & (local < rows)
        emb = F.embedding(local.clamp(0, rows - 1), self.stage.embed)
        return self.reduce(emb * inside.unsqueeze(1).to(emb.dtype))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of the partial row-parallel output ``x [T, H]``."""
        return self.collectives.all_reduce(x)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` -> fp32 ``[R, V]``: the local ``[R, Vp]`` logits gathered over the TP group,
        the padding columns of the last shard dropped."""
        local = F.linear(normed, self.stage.lm_head).float()
        return self.collectives.all_gather_cols(local)[:, :self.vocab_size]
