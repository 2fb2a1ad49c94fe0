"""GPU fast path of one pipeline stage: the stage's layers over a paged KV cache with the Triton
attention kernels (:mod:`runtime.model.kernels.attention`), written so a decode step can be captured
in a CUDA graph (no host sync, no data-dependent shapes; every size is fixed by the step's row
count).

It reuses a :class:`~runtime.model.stage.StageModel`'s parameters (embedding, fused QKV / gate-up,
norms, LM head) and the same numerics as ``runtime.model.layers`` (fp32 RMSNorm, half-split RoPE,
SwiGLU); only the KV cache layout and the attention differ. The CPU keeps the exact,
batch-invariant reference path of ``StageModel.forward``; this module is for CUDA (it also runs on
the CPU through the torch reference backend of the kernels, which tests use).

Cache layout (shared with the paged KV cache work, ``docs/gpu.md``): ``kv_cache [L, 2, num_blocks,
block_size, KVH, D]``; layer i uses ``kv_cache[i, 0]`` / ``kv_cache[i, 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runtime.model.kernels.attention import choose_num_splits, paged_attention
from runtime.model.kernels.fused import add_rms_norm, rope_write_kv, silu_mul
from runtime.model.kernels.moe import moe_forward
from runtime.model.layers import rms_norm
from runtime.model.rope import model_rope_tables
from runtime.model.stage import StageModel


@dataclass
class PagedMeta:
    """One step's attention metadata on the device (R rows, T tokens), shared by every layer.

    Attributes:
        positions: ``[T]`` int64 absolute position of each token.
        slot_mapping: ``[T]`` int64 flat KV index (block * block_size + offset); -1 = no write.
        block_tables: ``[R, MB]`` int32 block ids of each row.
        seq_lens: ``[R]`` int32 keys of each row after this step (0 for padding rows).
        query_start_loc: ``[R + 1]`` int32 cumulative query lengths.
        logits_indices: ``[R]`` int64 index (into T) of each row's last token.
        max_query_len: largest query length (Python int; 1 for decode-only steps).
        num_splits: split-K partitions of the decode attention (Python int).
    """
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor
    max_query_len: int
    num_splits: int = 1

    @staticmethod
    def build(block_tables: np.ndarray, start_positions: np.ndarray, query_lens: np.ndarray,
              block_size: int, device: torch.device, num_kv_heads: int = 1) -> "PagedMeta":
        """Host-side construction (numpy), one copy per tensor to ``device``.

        Args:
            block_tables: ``[R, MB]`` int block ids (enough blocks for ``start + query_len`` tokens).
            start_positions: ``[R]`` tokens already cached per row; query_lens: ``[R]`` >= 1.
        Raises:
            ValueError: a row needs more blocks than its table has.
        """
        start = np.asarray(start_positions, dtype=np.int64)
        query_len = np.asarray(query_lens, dtype=np.int64)
        bt = np.asarray(block_tables, dtype=np.int32)
        seq = start + query_len
        if int(seq.max()) > bt.shape[1] * block_size:
            raise ValueError(f"a row needs {int(seq.max())} tokens but block_tables hold "
                             f"{bt.shape[1]} blocks of {block_size}")
        qsl = np.concatenate([[0], np.cumsum(query_len)])
        row = np.repeat(np.arange(len(query_len)), query_len)
        pos = start[row] + np.arange(qsl[-1]) - qsl[row]
        slots = bt[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(device, dt)  # noqa: E731
        max_query_len = int(query_len.max())
        splits = (choose_num_splits(len(query_len), num_kv_heads, int(seq.max()))
                  if max_query_len == 1 else 1)
        return PagedMeta(to(pos, torch.int64), to(slots, torch.int64), to(bt, torch.int32),
                         to(seq, torch.int32), to(qsl, torch.int32), to(qsl[1:] - 1, torch.int64),
                         max_query_len, splits)

    @staticmethod
    def from_batch(meta, num_kv_heads: int) -> "PagedMeta":
        """The paged fields of a :class:`~runtime.model.batch_meta.BatchMeta` (already on the
        device; nothing is copied)."""
        splits = (choose_num_splits(meta.num_rows, num_kv_heads, meta.max_seq_len)
                  if meta.max_query_len == 1 else 1)
        return PagedMeta(meta.positions, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                         meta.query_start_loc, meta.last_token, meta.max_query_len, splits)


class PagedStage:
    """The layers of ``stage`` over its paged KV cache (see module doc).

    Args:
        stage: a loaded :class:`StageModel`; its ``kv_cache`` is the cache used (shared).
        num_blocks: if given, (re)allocate the stage's cache with this many blocks first.
        max_model_len: longest context (tokens) for the RoPE tables; default: the stage's.
    Attributes:
        kv_cache: the stage's ``[L, 2, num_blocks, block_size, KVH, D]`` cache.
    """

    def __init__(self, stage: StageModel, num_blocks: int | None = None,
                 max_model_len: int | None = None) -> None:
        self.stage, self.cfg = stage, stage.cfg
        if num_blocks is not None:
            stage.allocate_kv_cache(num_blocks)
        self.block_size = stage.block_size
        p = next(stage.parameters())
        if max_model_len is None or max_model_len <= stage.rope_cos.shape[0]:
            self.rope_cos, self.rope_sin = stage.rope_cos, stage.rope_sin
        else:
            cos, sin = model_rope_tables(self.cfg, max_model_len)
            self.rope_cos, self.rope_sin = cos.to(p.device, p.dtype), sin.to(p.device, p.dtype)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.stage.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.stage.num_blocks

    @torch.inference_mode()
    def forward(self, meta: PagedMeta, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """One step (T tokens, R rows); same inputs / outputs as ``StageModel.forward``:
        first stage ``input_ids [T]``, later ones ``hidden, residual [T, H]``; returns
        ``(hidden, residual)`` or, on the last stage, fp32 logits ``[R, V]``."""
        st, cfg = self.stage, self.cfg
        if st.is_first:
            hidden, residual = self.embed(input_ids), None
        for i, layer in enumerate(st.layers):
            hidden, residual = self._layer(layer, hidden, residual, meta, self.kv_cache[i])
        if not st.is_last:
            return hidden, residual
        last = hidden.index_select(0, meta.logits_indices)
        if residual is not None:
            last = last + residual.index_select(0, meta.logits_indices)
        return self.logits(rms_norm(last, st.norm, cfg.rms_norm_eps))

    # ---- the three places tensor parallelism hooks into (runtime/model/tp/paged.py) ----------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, H]`` embeddings."""
        return F.embedding(input_ids, self.stage.embed)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of a row-parallel output ``x [T, H]`` over the TP group: ``x`` itself here."""
        return x

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` normed last hidden states -> fp32 logits ``[R, V]``."""
        return F.linear(normed, self.stage.lm_head).float()

    def _layer(self, layer, x, residual, meta: PagedMeta, kv):
        """One decoder layer; a dense one in 9 launches: add+norm, QKV GEMM (bias folded into
        it), q/k norm + RoPE + KV write, attention, O GEMM, add+norm, gate/up GEMM, SiLU*up, down
        GEMM. An MoE layer replaces the last three with :func:`moe_forward`."""
        cfg = self.cfg
        h, d = cfg.num_heads, cfg.head_dim
        normed, residual = add_rms_norm(x, residual, layer.ln1, cfg.rms_norm_eps)
        qkv = F.linear(normed, layer.qkv, layer.qkv_bias)
        q = rope_write_kv(qkv, self.rope_cos, self.rope_sin, meta.positions, meta.slot_mapping,
                          kv[0], kv[1], h, q_norm=layer.q_norm, k_norm=layer.k_norm,
                          eps=cfg.rms_norm_eps)
        attn = paged_attention(q, kv[0], kv[1], meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, meta.max_query_len, d ** -0.5,
                               num_splits=meta.num_splits)
        o = self.reduce(F.linear(attn.view(-1, h * d), layer.o, layer.o_bias))
        normed, residual = add_rms_norm(o, residual, layer.ln2, cfg.rms_norm_eps)
        if layer.moe:
            return self.reduce(moe_forward(normed, layer.router, layer.experts_gate_up,
                                           layer.experts_down, cfg.experts_per_token,
                                           cfg.moe_renormalize)), residual
        return self.reduce(F.linear(silu_mul(F.linear(normed, layer.gate_up)), layer.down)), residual
