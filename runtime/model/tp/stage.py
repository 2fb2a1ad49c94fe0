"""A pipeline stage run by a tensor-parallel (TP) group: each TP rank holds its slice of the
stage's tensors (:mod:`runtime.model.tp.shard`) and runs the unsharded decoder code on it, with the
collectives of :mod:`runtime.model.tp.comm` at the three places TP needs them:

* after the O projection and after the MLP's down projection (row-parallel): one all-reduce each;
* the embedding (first stage, vocab-parallel): ids outside the rank's vocabulary shard read zeros,
  and an all-reduce sums the one non-zero row;
* the LM head (last stage, vocab-parallel): each rank computes ``[R, Vp]`` logits, an all-gather
  joins them to ``[R, V]`` on every TP rank.

Every TP rank of the last stage therefore holds the full logits and samples from them with the same
generator state (seeded alike at start, :meth:`TPComm.broadcast_seed`; seeded requests use their
own per-token hash anyway): see docs/tp.md for why sampling on every rank was chosen over gathering
to TP rank 0.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.model.decoder import DecoderLayer
from runtime.model.errors import PartitionError
from runtime.model.registry import resolve_model_path
from runtime.model.stage import StageModel
from runtime.model.tensor_names import stage_tensor_names
from runtime.model.tp.comm import TPComm
from runtime.model.tp.shard import TPShardPlan
from runtime.model.weights import open_checkpoint
from tqdm.auto import tqdm


class TPDecoderLayer(DecoderLayer):
    """A :class:`DecoderLayer` over one TP rank's slice; :attr:`comm` is set by :class:`TPStageModel`."""
    comm: TPComm

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) of the partial row-parallel output ``x [T, H]`` over the TP group."""
        return self.comm.all_reduce(x)


class TPStageModel(StageModel):
    """A :class:`StageModel` whose tensors are one TP rank's slices.

    Args:
        comm: the stage's TP group. plan: the slices this rank holds (its ``local_config()`` is
            the ``cfg`` of the layers and KV cache). Other arguments as :class:`StageModel`,
            ``weights`` already sliced (:meth:`TPShardPlan.read`).

    Attributes:
        embed, lm_head: ``[Vp, H]`` vocabulary shards (``Vp = ceil(V / tp)``, zero-padded).
        kv_cache: as :class:`StageModel`, with the rank's ``num_kv_heads`` (``max(KVH / tp, 1)``).
    """

    layer_cls = TPDecoderLayer

    def __init__(self, comm: TPComm, plan: TPShardPlan, layer_range: tuple[int, int],
                 weights: dict[str, torch.Tensor], **kwargs) -> None:
        super().__init__(plan.local_config(), layer_range, weights, **kwargs)
        self.comm, self.plan = comm, plan
        self.vocab_size = plan.cfg.vocab_size
        for layer in self.layers:
            layer.comm = comm

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: ``[T]`` ids -> ``[T, H]``, summed over the TP group."""
        local = input_ids - self.plan.vocab_start
        inside = (local >= 0) & (local < self.plan.vocab_rows)
        rows = self.embed[local.clamp(0, self.plan.vocab_rows - 1)]
        return self.comm.all_reduce(torch.where(inside[:, None], rows, torch.zeros_like(rows)))

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` -> fp32 ``[R, V]``: the local ``[R, Vp]`` logits gathered over the TP group
        (padding columns dropped)."""
        return self.comm.all_gather_cols(super().logits(normed))[:, :self.vocab_size]


def load_tp_stage(model: str | Path, layer_range: tuple[int, int], comm: TPComm, *,
                  max_num_reqs: int, max_model_len: int, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", progress: bool = True,
                  batch_invariant: bool = True, block_size: int = 16,
                  num_blocks: int | None = None) -> TPStageModel:
    """Load TP rank ``comm.rank``'s slice of the stage owning layers ``[start, end)``.

    Only this stage's tensors are read, and of each sharded one only this rank's slice where the
    checkpoint format allows (safetensors slices; a GGUF tensor is dequantized whole, one at a
    time, then narrowed). Arguments as :func:`runtime.model.stage.load_stage`.

    Raises:
        PartitionError: invalid layer range. ValueError: the model cannot be split ``comm.size``
        ways (``--tp``). The loader errors of :func:`runtime.model.stage.load_stage`.
    """
    ckpt = open_checkpoint(resolve_model_path(model))
    cfg = ckpt.config
    start, end = layer_range
    if not 0 <= start < end <= cfg.num_layers:
        raise PartitionError(f"layer range {layer_range} is invalid for {cfg.num_layers} layers")
    plan = TPShardPlan(cfg, comm.rank, comm.size)
    names = stage_tensor_names(cfg, layer_range)
    weights = {}
    for name in tqdm(names, desc=f"loading {ckpt.path.name} (TP {comm.rank}/{comm.size})",
                     unit="tensor", disable=not progress, leave=False):
        weights[name] = plan.read(ckpt, name).to(device=device, dtype=dtype)
    return TPStageModel(comm, plan, (start, end), weights, max_num_reqs=max_num_reqs,
                        max_model_len=max_model_len, dtype=dtype, device=device,
                        freq_factors=ckpt.rope_freq_factors(), batch_invariant=batch_invariant,
                        block_size=block_size, num_blocks=num_blocks).eval()
