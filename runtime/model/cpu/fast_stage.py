"""One pipeline stage on the CPU fast path: quantized GEMMs and RoPE in ONNX Runtime segments
(:mod:`runtime.model.cpu.segments`), attention in torch over the same paged KV cache (the reference
path's row groups and masks; grouped two-matmul attention for decode rows, SDPA for prefill
rows; per layer one cache write and one context read).

Drop-in for :class:`~runtime.model.stage.StageModel` in a worker: same ``forward(meta, ...)``
contract (first stage ``input_ids [T]``; later ones ``hidden, residual [T, H]``; the last returns
fp32 logits ``[R, V]``), same KV cache layout and ``allocate_kv_cache``, same input checks. Results
are close to, not equal to, the reference (int8 activations, 8- or 4-bit weights): see
``docs/cpu_fast_path.md`` for the measured agreement.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from runtime.model.batch_meta import BatchMeta, contiguous_block_table
from runtime.model.cpu.quant_weights import read_embedding, read_head, read_layer
from runtime.model.cpu.segments import head_segment, mid_segment, tail_segment
from runtime.model.errors import PartitionError, UnsupportedModelError
from runtime.model.layers import _grouped_attention, rope_inv_freq, rope_tables
from runtime.model.paged_attention import head_major_index
from runtime.model.registry import resolve_model_path
from runtime.model.rope import rope_type
from runtime.model.stage import StageModel
from runtime.model.weights import open_checkpoint


def _np(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.numpy())


class CpuFastStage(nn.Module):
    """Layers ``[start, end)`` with quantized weights (see module doc); build with
    :func:`load_fast_stage`.

    Attributes:
        kv_cache: ``[L, 2, num_blocks, block_size, KVH, D]`` fp32 (as ``StageModel``).
        weight_bytes: bytes of the quantized weights held by the ONNX Runtime sessions plus the
            embedding.
    """

    allocate_kv_cache = StageModel.allocate_kv_cache
    _check = StageModel._check

    def __init__(self, ckpt, layer_range: tuple[int, int], *, max_num_reqs: int,
                 max_model_len: int, block_size: int = 16, num_blocks: int | None = None,
                 bits: int = 8, accuracy_level: int = 4, progress: bool = False) -> None:
        super().__init__()
        cfg = self.cfg = ckpt.config
        self.layer_start, self.layer_end = layer_range
        self.is_first, self.is_last = self.layer_start == 0, self.layer_end == cfg.num_layers
        self.max_num_reqs, self.max_model_len, self.block_size = max_num_reqs, max_model_len, block_size
        eps, n = cfg.rms_norm_eps, self.layer_end - self.layer_start
        self.embed = read_embedding(ckpt) if self.is_first else None
        head = read_head(ckpt) if self.is_last else None
        self.weight_bytes = 0 if self.embed is None else self.embed.q.numel() + self.embed.scales.numel() * 4
        self.layers, self.segments, prev = [None] * n, [], None
        heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        for j in tqdm(range(n), desc="quantized layers", disable=not progress, leave=False):
            layer = read_layer(ckpt, self.layer_start + j, bits)
            self.weight_bytes += sum(w.packed.nbytes + w.scales.nbytes + (
                0 if w.zero_points is None else w.zero_points.nbytes)
                for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
            self.segments.append(head_segment(layer, heads, accuracy_level, eps) if prev is None
                                 else mid_segment(prev, layer, heads, accuracy_level, eps))
            prev = layer
        self.segments.append(tail_segment(prev, accuracy_level, eps, head))
        if head is not None:
            self.weight_bytes += head[1].packed.nbytes + head[1].scales.nbytes
        self.norm_weight = nn.Parameter(torch.from_numpy(prev.ln1.copy()), requires_grad=False)
        cos, sin = rope_tables(rope_inv_freq(cfg, ckpt.rope_freq_factors()
                                             if hasattr(ckpt, "rope_freq_factors") else None),
                               max_model_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.default_block_table = contiguous_block_table(max_num_reqs, max_model_len, block_size)
        self.register_buffer("kv_cache", torch.zeros(0), persistent=False)
        self.allocate_kv_cache(num_blocks or self.default_block_table.numel(), torch.float32, "cpu")

    @torch.inference_mode()
    def forward(self, meta: BatchMeta, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """One step (T tokens, R rows); contract and errors of ``StageModel.forward``."""
        if meta.own_layout:
            meta = BatchMeta.build(meta.slots.cpu(), meta.start_positions.cpu(), meta.query_lens.cpu(),
                                   self.kv_cache.device, self.default_block_table, self.block_size)
        self._check(meta, input_ids, hidden)
        if self.is_first:
            hidden = self.embed(input_ids)
            residual = torch.zeros_like(hidden)
        elif residual is None:
            residual = torch.zeros_like(hidden)
        rope = {"pos": np.arange(meta.num_tokens, dtype=np.int64)[None],
                "cos": _np(self.rope_cos.index_select(0, meta.positions)),
                "sin": _np(self.rope_sin.index_select(0, meta.positions))}
        plan = _AttnPlan(meta)
        q, kv, res = self.segments[0].run(None, {"x": _np(hidden.float()), "res": _np(residual.float()),
                                                  **rope})
        last = len(self.layers) - 1
        for i in range(last + 1):
            attn = _np(self._attend(torch.from_numpy(q), torch.from_numpy(kv), plan, i))
            if i < last:
                q, kv, res = self.segments[i + 1].run(None, {"x": attn, "res": res, **rope})
        if self.is_last:
            rows = _np(meta.last_token.to(torch.int64))
            return torch.from_numpy(self.segments[-1].run(None, {"x": attn, "res": res, "rows": rows})[0])
        out, res = self.segments[-1].run(None, {"x": attn, "res": res})
        return torch.from_numpy(out), torch.from_numpy(res)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, plan: "_AttnPlan", i: int) -> torch.Tensor:
        """KV write and attention of local layer ``i`` (RoPE already applied by the segment):
        ``q [T, NH D]``, ``kv [2, T, KVH D]`` -> ``[T, NH D]``.

        Both planes of the layer's cache are written with one ``index_copy_``; each group's
        context (keys and values together) is read with one ``index_select`` into the head-major
        layout ``[2, Rg, KVH, L, D]``. Decode rows use the grouped two-matmul form of
        ``layers._grouped_attention`` (query heads sharing a KV head stacked, K/V never repeated;
        10-25% less CPU than SDPA's flash kernel at 8-64 decode rows), prefill rows SDPA.
        """
        cfg = self.cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        layer = self.kv_cache[i]                          # [2, blocks, block_size, KVH, D]
        if plan.keep is not None:
            kv = kv.index_select(1, plan.keep)
        layer.view(2, -1, kvh * d).index_copy_(1, plan.write, kv)
        out = None if plan.dense else q.new_empty(q.shape)
        for g, idx in zip(plan.groups, plan.context_index(layer[0].numel() // d, kvh)):
            rows = g.slots.shape[0]
            ctx = layer.view(-1, d).index_select(0, idx).view(2, rows, kvh, g.kv_len, d)
            qg = q if out is None else q.index_select(0, g.gather)
            qg = qg.view(rows, g.q_max, h, d).transpose(1, 2)
            if g.q_max == 1:   # decode rows
                o = _grouped_attention(qg, ctx[0], ctx[1], g.mask)
            else:
                o = F.scaled_dot_product_attention(qg, ctx[0], ctx[1], attn_mask=g.mask, enable_gqa=True)
            o = o.transpose(1, 2).reshape(rows * g.q_max, h * d)
            if out is None:
                return o
            out.index_copy_(0, g.tokens, o.index_select(0, g.padded))
        return out


class _AttnPlan:
    """What every layer's attention of one step shares: the KV write index (``write [T']``, with
    ``keep [T']`` the tokens written when some have no cache cell, ``slot_mapping == -1``), the
    groups of ``meta``, whether there is a single dense one (queries already in token order), and
    each group's context index (:meth:`context_index`, built by the first layer)."""

    def __init__(self, meta: BatchMeta) -> None:
        keep = meta.slot_mapping >= 0
        self.keep = None if bool(keep.all()) else keep.nonzero()[:, 0]
        self.write = meta.slot_mapping if self.keep is None else meta.slot_mapping[self.keep]
        self.groups = meta.groups
        self.dense = len(meta.groups) == 1 and meta.groups[0].dense
        self._context = None

    def context_index(self, plane: int, kvh: int) -> list[torch.Tensor]:
        """Per group ``[2 * Rg * KVH * L]`` long: rows of a layer's cache viewed ``[2 * plane, D]``
        (``plane`` = D-vectors per K or V plane) holding its keys, then its values, head major."""
        if self._context is None:
            self._context = []
            for g in self.groups:
                idx = head_major_index(g.kv_index, g.slots.shape[0], g.kv_len, kvh)
                self._context.append(torch.cat([idx, idx + plane]))
        return self._context


def fast_path_unsupported(cfg) -> str | None:
    """Why the CPU fast path cannot run the model of ``cfg`` (a ``ModelConfig``), or None.

    The fast path's fused segments implement the Llama/Mistral decoder layer (no Q/K/V/O biases, no
    per-head q/k norm, a dense MLP) with default, linear or llama3 RoPE; a model using another
    piece of its family (docs/families.md) runs on the exact path instead.
    """
    pieces = [name for name, used in (("qkv bias", cfg.qkv_bias), ("o bias", cfg.o_bias),
                                      ("q/k norm", cfg.qk_norm), ("experts", cfg.num_experts > 0))
              if used]
    kind = rope_type(cfg.rope_scaling)
    if kind not in ("default", "linear", "llama3"):
        pieces.append(f"rope {kind}")
    if cfg.family != "llama" or pieces:
        return f"family {cfg.family!r}" + (f" with {', '.join(pieces)}" if pieces else "")
    return None


def load_fast_stage(model: str | Path, layer_range: tuple[int, int], *, max_num_reqs: int,
                    max_model_len: int, block_size: int = 16, num_blocks: int | None = None,
                    bits: int = 8, accuracy_level: int = 4, progress: bool = False) -> CpuFastStage:
    """Load the stage owning layers ``[start, end)`` for the CPU fast path (see
    :class:`CpuFastStage`; ``bits``: 8 or 4 for the layer GEMMs; ``accuracy_level``: the
    ``MatMulNBits`` compute type, 4 = int8 activations, 1 = fp32).

    Raises:
        PartitionError: invalid layer range; the errors of resolving / reading the checkpoint.
        UnsupportedModelError: a model the fast path does not implement (:func:`fast_path_unsupported`).
    """
    ckpt = open_checkpoint(resolve_model_path(model))
    reason = fast_path_unsupported(ckpt.config)
    if reason is not None:
        raise UnsupportedModelError(f"the CPU fast path does not run {reason}; use --cpu-path exact")
    start, end = layer_range
    if not 0 <= start < end <= ckpt.config.num_layers:
        raise PartitionError(f"layer range {layer_range} is invalid for {ckpt.config.num_layers} layers")
    stage = CpuFastStage(ckpt, layer_range, max_num_reqs=max_num_reqs, max_model_len=max_model_len,
                         block_size=block_size, num_blocks=num_blocks, bits=bits,
                         accuracy_level=accuracy_level, progress=progress).eval()
    _release_free_memory()
    return stage


def _release_free_memory() -> None:
    """Hand the loader's freed temporaries (fp32 blocks, serialized graphs) back to the OS
    (glibc keeps them otherwise: ~140 MiB of RSS per rank)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
