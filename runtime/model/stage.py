"""One pipeline stage: a contiguous range of decoder layers, its paged KV cache, and (first stage)
the embedding / (last stage) final norm + LM head. :func:`load_stage` reads only that stage's tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from runtime.model.batch_meta import BatchMeta, contiguous_block_table
from runtime.model.config import ModelConfig
from runtime.model.errors import PartitionError
from runtime.model.decoder import DecoderLayer
from runtime.model.layers import linear, rms_norm
from runtime.model.registry import resolve_model_path
from runtime.model.rope import model_rope_tables
from runtime.model.tensor_names import (EMBED, FINAL_NORM, LM_HEAD, layer_name, layer_suffixes,
                                        stage_tensor_names)
from runtime.model.weights import load_tensors, open_checkpoint

__all__ = ["BatchMeta", "StageModel", "load_stage", "load_model_config"]

INVARIANT_ROWS = 16  # GEMM rows below which CPU sgemm changes kernel (see layers.linear)


class StageModel(nn.Module):
    """Layers ``[layer_start, layer_end)`` of a decoder (any declared family) plus their paged KV cache.

    Built from a dict of canonical-name tensors (see ``tensor_names.stage_tensor_names``); tensors are
    moved/cast to ``device`` / ``dtype`` when they differ. Use :func:`load_stage` to read them.

    Attributes:
        kv_cache: ``[num_local_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` in the
            model dtype, allocated once (zeros); layer i reads ``kv_cache[i, 0]`` (K) and
            ``kv_cache[i, 1]`` (V). ``num_blocks`` defaults to room for ``max_model_len`` tokens
            in every slot (``max_num_reqs * ceil(max_model_len / block_size)``).
        default_block_table: ``[max_num_reqs, ceil(max_model_len / block_size)]`` contiguous
            table used for a :class:`BatchMeta` built without one (``meta.own_layout``).
        embed: ``[V, H]`` (first stage); norm ``[H]`` and lm_head ``[V, H]`` (last stage).
        min_rows: GEMM inputs are padded to this many rows (16 with ``batch_invariant`` on the
            CPU, else 0), and attention uses explicit matmuls instead of SDPA: a row's result then
            does not depend on the rest of the batch nor on prefill chunking.
    """

    layer_cls = DecoderLayer   # a tensor-parallel stage builds its own (runtime/model/tp/stage.py)

    def __init__(self, cfg: ModelConfig, layer_range: tuple[int, int], weights: dict[str, torch.Tensor],
                 *, max_num_reqs: int, max_model_len: int, dtype: torch.dtype,
                 device: str | torch.device, freq_factors: torch.Tensor | None = None,
                 batch_invariant: bool = True, block_size: int = 16,
                 num_blocks: int | None = None) -> None:
        super().__init__()
        weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}  # no-op if so
        self.cfg, (self.layer_start, self.layer_end) = cfg, layer_range
        self.is_first, self.is_last = self.layer_start == 0, self.layer_end == cfg.num_layers
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self.min_rows = INVARIANT_ROWS if batch_invariant and torch.device(device).type == "cpu" else 0
        p = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.embed = p(weights[EMBED]) if self.is_first else None
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, {s: weights[layer_name(i, s)] for s in layer_suffixes(cfg, i)},
                         self.min_rows, i)
            for i in range(self.layer_start, self.layer_end))
        self.norm = p(weights[FINAL_NORM]) if self.is_last else None
        self.lm_head = None
        if self.is_last:  # tied: reuse the first stage's parameter, or the embedding read for it
            tied_here = LM_HEAD not in weights and self.embed is not None
            self.lm_head = self.embed if tied_here else p(weights.get(LM_HEAD, weights.get(EMBED)))
        cos, sin = model_rope_tables(cfg, max_model_len, freq_factors)
        self.register_buffer("rope_cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(device=device, dtype=dtype), persistent=False)
        self.block_size = block_size
        self.default_block_table = contiguous_block_table(max_num_reqs, max_model_len, block_size)
        self.register_buffer("kv_cache", torch.zeros(0), persistent=False)
        self.allocate_kv_cache(num_blocks or self.default_block_table.numel(), dtype, device)

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype | None = None,
                          device: str | torch.device | None = None) -> None:
        """(Re)allocate the zeroed cache with ``num_blocks`` blocks (a worker sizes it after the
        weights are loaded, from the memory left). Shape: see the class attributes."""
        dtype = dtype or self.kv_cache.dtype
        device = device or self.kv_cache.device
        cfg = self.cfg
        self.kv_cache = torch.empty(0)  # free the old one first
        shape = (len(self.layers), 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def forward(self, meta: BatchMeta, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """Run this stage's layers on one step's flat batch.

        Args:
            meta: the step's :class:`BatchMeta` (T tokens, R rows).
            input_ids: ``[T]`` long token ids (first stage only).
            hidden, residual: ``[T, H]`` from the previous stage (later stages only).
        Returns:
            non-last stage: ``(hidden, residual)`` each ``[T, H]`` in the model dtype;
            last stage: fp32 logits ``[R, V]`` at each row's last token.
        Raises:
            ValueError: wrong inputs for the stage kind, or a position beyond ``max_model_len``,
                a slot beyond ``max_num_reqs`` or a block id beyond ``num_blocks``.
        """
        if meta.own_layout:
            meta = BatchMeta.build(meta.slots.cpu(), meta.start_positions.cpu(), meta.query_lens.cpu(),
                                   self.kv_cache.device, self.default_block_table, self.block_size)
        self._check(meta, input_ids, hidden)
        if self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        cos = self.rope_cos.index_select(0, meta.positions)
        sin = self.rope_sin.index_select(0, meta.positions)
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, meta, cos, sin, self.kv_cache[i, 0],
                                     self.kv_cache[i, 1])
        if not self.is_last:
            return hidden, residual
        last = hidden.index_select(0, meta.last_token)
        if residual is not None:
            last = last + residual.index_select(0, meta.last_token)
        return self.logits(rms_norm(last, self.norm, self.cfg.rms_norm_eps))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, H]`` embeddings (vocab-parallel under TP)."""
        return self.embed[input_ids]

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` normed last hidden states -> fp32 logits ``[R, V]`` (gathered under TP)."""
        return linear(normed, self.lm_head, self.min_rows).float()

    def _check(self, meta: BatchMeta, input_ids: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """Validate the inputs of :meth:`forward` (cheap: Python ints already in ``meta``)."""
        if self.is_first and (input_ids is None or input_ids.shape[0] != meta.num_tokens):
            raise ValueError(f"stage {self.layer_start}-{self.layer_end} needs input_ids [{meta.num_tokens}]")
        if not self.is_first and (hidden is None or hidden.shape[0] != meta.num_tokens):
            raise ValueError(f"stage {self.layer_start}-{self.layer_end} needs hidden [{meta.num_tokens}, H]")
        if meta.max_context > self.max_model_len:
            raise ValueError(f"context {meta.max_context} exceeds max_model_len {self.max_model_len}")
        if meta.slot_bounds[0] < 0 or meta.slot_bounds[1] >= self.max_num_reqs:
            raise ValueError(f"slot out of range [0, {self.max_num_reqs}): {meta.slots.tolist()}")
        if meta.block_bounds[0] < 0 or meta.block_bounds[1] >= self.num_blocks:
            raise ValueError(f"block id out of range [0, {self.num_blocks}): {meta.block_bounds}")
        if meta.block_size != self.block_size:
            raise ValueError(f"step built for block_size {meta.block_size}, cache has {self.block_size}")


def load_model_config(model: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of ``model`` (``default``, a .gguf file or an HF folder); reads metadata
    only. Raises the errors of ``resolve_model_path`` and of the checkpoint readers."""
    return open_checkpoint(resolve_model_path(model)).config


def load_stage(model: str | Path, layer_range: tuple[int, int], *, max_num_reqs: int,
               max_model_len: int, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", progress: bool = True,
               batch_invariant: bool = True, block_size: int = 16,
               num_blocks: int | None = None) -> StageModel:
    """Load the stage owning layers ``[start, end)``: only its tensors are read and dequantized.

    Args:
        model: ``default``, a .gguf file or an HF folder.
        layer_range: ``(start, end)`` with ``0 <= start < end <= num_layers``; the stage is first
            when ``start == 0`` and last when ``end == num_layers``.
        max_num_reqs, max_model_len: slots and tokens per request.
        block_size, num_blocks: paged KV cache geometry (see :class:`StageModel`).
        progress: show a tqdm bar while reading tensors.
        batch_invariant: pad small GEMMs (CPU) so results do not depend on batch composition or
            prefill chunking (one torch thread); costs up to ~2x matmul time for batches < 16 tokens.
    Raises:
        PartitionError: invalid layer range. ModelNotFoundError / UnsupportedModelError /
        WeightShapeError / ModelError from resolving and reading the checkpoint.
    """
    ckpt = open_checkpoint(resolve_model_path(model))
    cfg = ckpt.config
    start, end = layer_range
    if not 0 <= start < end <= cfg.num_layers:
        raise PartitionError(f"layer range {layer_range} is invalid for {cfg.num_layers} layers")
    weights = load_tensors(ckpt, stage_tensor_names(cfg, layer_range), dtype=dtype, device=device,
                           progress=progress)
    factors = ckpt.rope_freq_factors()
    return StageModel(cfg, (start, end), weights, max_num_reqs=max_num_reqs,
                      max_model_len=max_model_len, dtype=dtype, device=device,
                      freq_factors=factors, batch_invariant=batch_invariant,
                      block_size=block_size, num_blocks=num_blocks).eval()
