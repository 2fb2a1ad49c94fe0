"""Which slice of each checkpoint tensor a tensor-parallel (TP) rank holds (Megatron-LM layout,
Shoeybi et al. 2019; vLLM's ``ColumnParallelLinear`` / ``RowParallelLinear`` /
``VocabParallelEmbedding``).

With ``tp`` ranks, TP rank ``r`` holds:

* attention: query heads ``[r * NH/tp, (r+1) * NH/tp)`` (rows of ``q_proj``, columns of
  ``o_proj``) and KV heads ``[r * KVH // tp, ... + max(KVH/tp, 1))``: with fewer KV heads than
  ranks each KV head is replicated on the ``tp / KVH`` ranks whose query heads read it;
* dense MLP: rows ``[r * I/tp, (r+1) * I/tp)`` of ``gate_proj`` / ``up_proj`` and the same
  columns of ``down_proj``; MoE: the same split of every expert's intermediate dimension (weight
  shards, every rank holds every expert), router replicated;
* vocabulary: rows ``[r * Vp, (r+1) * Vp)`` of the embedding and LM head, ``Vp = ceil(V / tp)``,
  the last shard zero-padded to ``Vp`` rows;
* replicated: the norms, per-head q/k norms, the router; ``o_proj.bias`` on rank 0 only (zeros
  elsewhere), so the all-reduce of the partial O outputs adds it once.

The local :class:`ModelConfig` (:meth:`TPShardPlan.local_config`) has the per-rank head and
intermediate counts, so the unsharded attention / MLP code runs unchanged on a rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model.config import ModelConfig
from runtime.model.errors import WeightShapeError
from runtime.model.tensor_names import EMBED, LM_HEAD, O_BIAS_SUFFIX, expected_shape, split_layer_name

#: layer suffix -> dimension split by heads/intermediate ("q": query heads, "kv": KV heads,
#: "i": intermediate); dimension index within the tensor
_SPLIT = {
    "self_attn.q_proj.weight": ("q", 0), "self_attn.q_proj.bias": ("q", 0),
    "self_attn.k_proj.weight": ("kv", 0), "self_attn.k_proj.bias": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0), "self_attn.v_proj.bias": ("kv", 0),
    "self_attn.o_proj.weight": ("q", 1),
    "mlp.gate_proj.weight": ("i", 0), "mlp.up_proj.weight": ("i", 0), "mlp.down_proj.weight": ("i", 1),
    "mlp.experts.gate_proj": ("mi", 1), "mlp.experts.up_proj": ("mi", 1),
    "mlp.experts.down_proj": ("mi", 2),
}


def _unmet(cfg: ModelConfig, tp: int) -> list[str]:
    """The conditions on ``--tp`` that ``tp`` fails for model ``cfg`` (empty: ``tp`` is valid)."""
    unmet = []
    if cfg.num_heads % tp:
        unmet.append(f"divide the {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        unmet.append(f"divide the {cfg.num_kv_heads} KV heads or be a multiple of "
                     f"{cfg.num_kv_heads}")
    if cfg.intermediate_size % tp:
        unmet.append(f"divide the MLP intermediate size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % tp:
        unmet.append(f"divide the expert intermediate size {cfg.moe_intermediate_size}")
    return unmet


def valid_tp(cfg: ModelConfig) -> list[int]:
    """Every TP degree model ``cfg`` can be split by, ascending (``1`` always; none exceeds the
    number of attention heads)."""
    return [t for t in range(1, cfg.num_heads + 1) if not _unmet(cfg, t)]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP degree the model's shapes cannot be split by.

    Raises:
        ValueError: the message names the flag, the model's head counts, the conditions ``tp``
            fails and the valid values, e.g. ``--tp 2: the model has 9 attention heads and 3 KV
            heads; --tp must divide the 9 attention heads and divide the 3 KV heads or be a
            multiple of 3 (valid, with the MLP intermediate size 1536 split too: 1, 3)``.
    """
    unmet = _unmet(cfg, tp)
    if unmet:
        valid = ", ".join(map(str, valid_tp(cfg)))
        sizes = f"MLP intermediate size {cfg.intermediate_size}"
        if cfg.num_experts:
            sizes += f", expert intermediate size {cfg.moe_intermediate_size}"
        raise ValueError(f"--tp {tp}: the model has {cfg.num_heads} attention heads and "
                         f"{cfg.num_kv_heads} KV heads; --tp must {' and '.join(unmet)} "
                         f"(valid, with the {sizes} split too: {valid})")


@dataclass(frozen=True)
class TPShardPlan:
    """The slices TP rank ``rank`` of ``size`` holds of a model ``cfg`` (module doc).

    Raises (constructor):
        ValueError: as :func:`check_tp`, or ``rank`` outside ``[0, size)``.
    """
    cfg: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"--tp: TP rank {self.rank} outside [0, {self.size})")
        check_tp(self.cfg, self.size)

    @property
    def kv_heads(self) -> int:
        """KV heads this rank holds (1 when replicated)."""
        return max(self.cfg.num_kv_heads // self.size, 1)

    @property
    def vocab_rows(self) -> int:
        """``Vp = ceil(V / tp)``: rows of the local embedding / LM head (padded)."""
        return -(-self.cfg.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        """First token id of this rank's vocabulary shard."""
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The config of this rank's slice: heads, KV heads and intermediate sizes divided
        (vocabulary unchanged: logits are gathered to the full width)."""
        c, n = self.cfg, self.size
        return c.model_copy(update={
            "num_heads": c.num_heads // n, "num_kv_heads": self.kv_heads,
            "intermediate_size": c.intermediate_size // n,
            "moe_intermediate_size": c.moe_intermediate_size // n})

    def span(self, name: str) -> tuple[int, int, int] | None:
        """``(dim, start, stop)`` of canonical tensor ``name`` this rank reads, or None when it
        holds the whole tensor (replicated). The vocabulary span is clipped to ``V``."""
        c, r, d = self.cfg, self.rank, self.cfg.head_dim
        if name in (EMBED, LM_HEAD):
            start = self.vocab_start
            return 0, start, min(start + self.vocab_rows, c.vocab_size)
        parts = split_layer_name(name)
        if parts is None or parts[1] not in _SPLIT:
            return None
        kind, dim = _SPLIT[parts[1]]
        if kind == "q":
            per = c.num_heads // self.size * d
            return dim, r * per, (r + 1) * per
        if kind == "kv":
            first = r * c.num_kv_heads // self.size
            return dim, first * d, (first + self.kv_heads) * d
        width = c.intermediate_size if kind == "i" else c.moe_intermediate_size
        per = width // self.size
        return dim, r * per, (r + 1) * per

    def read(self, ckpt, name: str) -> torch.Tensor:
        """This rank's slice of ``name`` from checkpoint ``ckpt`` (fp32, CPU), shape-checked.

        Only the slice is read where the checkpoint can (``ckpt.read_slice``: safetensors
        slices); otherwise the tensor is read whole, one at a time, and narrowed.

        Raises:
            WeightShapeError: the tensor's full shape differs from :func:`expected_shape`.
        """
        span = self.span(name)
        full = expected_shape(self.cfg, name)
        if span is None:
            t = ckpt.read(name)
            if tuple(t.shape) != full:
                raise WeightShapeError(f"{ckpt.path}: tensor {name!r} has shape {tuple(t.shape)}, "
                                       f"expected {full}")
            if name.endswith(O_BIAS_SUFFIX) and self.rank:   # added once, by TP rank 0
                t = torch.zeros_like(t)
            return t
        dim, start, stop = span
        reader = getattr(ckpt, "read_slice", None)
        t = (reader(name, dim, start, stop) if reader is not None
             else ckpt.read(name).narrow(dim, start, stop - start).contiguous())
        want = list(full)
        want[dim] = stop - start
        if list(t.shape) != want:
            raise WeightShapeError(f"{ckpt.path}: slice [{start}:{stop}] (dim {dim}) of tensor "
                                   f"{name!r} has shape {tuple(t.shape)}, expected {tuple(want)}")
        if name in (EMBED, LM_HEAD) and t.shape[0] < self.vocab_rows:   # last shard: pad
            t = torch.cat([t, t.new_zeros(self.vocab_rows - t.shape[0], t.shape[1])])
        return t
