"""CUDA graphs of speculative verify steps (``--spec-tokens K``; issue #33).

A verify step is a step whose rows are all decode rows, row ``i`` carrying ``1 + k_i`` tokens
(``k_i <= K`` drafts, 0 included). Its shapes vary with the ``k_i``; the graph fixes them by
padding every row to ``W = K + 1`` query tokens: a bucket of ``b`` rows (the decode buckets of
:func:`~runtime.worker.cuda_graphs.bucket_sizes`) runs ``b * W`` tokens with
``query_start_loc = arange(b + 1) * W`` and logits at every one of them. Padding never changes a
real token's result:

* a padded position (``j > k_i``) sits after the row's real tokens: it writes no KV
  (``slot_mapping`` -1), has RoPE position 0, and no real query attends it (causal: real query
  ``j`` sees keys up to ``start + j``); its logits are computed but never gathered, so never
  accepted;
* a padded row (``i >= n``) has ``seq_len`` 0 (no keys, zero output) and writes nothing.

:meth:`VerifyGraphs.run` takes and returns the step's compact layout (``T`` real tokens), the
same as the eager :meth:`PagedStage.forward` with logits at every token: hidden states between
ranks keep the scheduler's ``T`` rows, and the last rank's verify reads the same logit rows.
Capture shares :class:`~runtime.worker.cuda_graphs.DecodeGraphs`' procedure (largest bucket
first, one memory pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.host_copy import to_device
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.worker.cuda_graphs import DecodeGraphs


@dataclass
class VerifyInputs:
    """The padded metadata of one verify step (``n`` rows in a bucket of ``b``, ``W = K + 1``).

    Attributes:
        bucket: ``b``.
        i64: ``[3 * b * W]`` int64 on the device: positions, slot mapping, then ``real`` padded
            (only its first ``T`` entries are read).
        i32: ``[b + n * width]`` int32 on the device: seq lens, then the rows' block tables.
        num_tokens: ``T`` real tokens; num_rows: ``n``; width: block-table columns sent.
    """
    bucket: int
    i64: torch.Tensor
    i32: torch.Tensor
    num_tokens: int
    num_rows: int
    width: int


class VerifyGraphs(DecodeGraphs):
    """Captured verify steps of one :class:`PagedStage` for ``K`` drafts per row.

    Args:
        model: the stage; max_num_seqs: largest batch (rows); max_blocks_per_seq: block-table
            width of a slot (``ceil(max_model_len / block_size)``); max_model_len: longest
            context; num_spec_tokens: ``K`` (>= 1).
    """

    def __init__(self, model: PagedStage, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, num_spec_tokens: int) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        super().__init__(model, max_num_seqs, max_blocks_per_seq, max_model_len)
        self.k = num_spec_tokens
        w = self.w = num_spec_tokens + 1
        dev = model.kv_cache.device
        n, cfg = self.buckets[-1], model.cfg
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.max_blocks = max_blocks_per_seq
        extra = -(-num_spec_tokens // model.block_size) + 1   # padded positions past the table
        self.input_ids = torch.zeros(n * w, **i64)                               # [n W]
        self.hidden = torch.zeros(n * w, cfg.hidden_size, dtype=model.kv_cache.dtype, device=dev)
        self.residual = torch.zeros_like(self.hidden)                            # [n W, H]
        self.positions = torch.zeros(n * w, **i64)                               # [n W]
        self.slot_mapping = torch.full((n * w,), -1, **i64)                      # [n W]
        self.block_tables = torch.zeros(n, max_blocks_per_seq + extra, **i32)    # [n, MB + e]
        self.seq_lens = torch.zeros(n, **i32)                                    # [n]
        self.query_start_loc = torch.arange(n + 1, **i32) * w                    # [n + 1], fixed
        self.logits_indices = torch.arange(n * w, **i64)                         # [n W], fixed

    def _meta(self, b: int) -> PagedMeta:
        t = b * self.w
        return PagedMeta(self.positions[:t], self.slot_mapping[:t], self.block_tables[:b],
                         self.seq_lens[:b], self.query_start_loc[:b + 1], self.logits_indices[:t],
                         max_query_len=self.w, num_splits=1)

    def _run(self, b: int):
        t = b * self.w
        if self.model.stage.is_first:
            return self.model.forward(self._meta(b), input_ids=self.input_ids[:t])
        return self.model.forward(self._meta(b), hidden=self.hidden[:t], residual=self.residual[:t])

    def inputs(self, slots: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
               decode: np.ndarray, block_table: np.ndarray, block_size: int) -> VerifyInputs | None:
        """The padded metadata of a step, or None when it is not a verify step a graph holds
        (a row still prefilling, no row with drafts, more rows than the largest bucket).

        Args:
            slots, starts, query_lens: ``[R]`` the step's rows (corrected start positions).
            decode: ``[R]`` bool, decode rows (:class:`~runtime.sampling.speculative_verify.SpecRows`).
            block_table: ``[max_num_reqs, MB]`` int32 host block table; block_size: tokens.
        """
        n, w = int(slots.size), self.w
        q = np.asarray(query_lens, dtype=np.int64)
        if n == 0 or not decode.all() or q.max() <= 1 or q.max() > w:
            return None
        b = next((x for x in self.buckets if x >= n), None)
        if b is None or (self.graphs and b not in self.graphs):
            return None
        start = np.asarray(starts, dtype=np.int64)
        j = np.tile(np.arange(w, dtype=np.int64), n).reshape(n, w)              # [n, W]
        real = j < q[:, None]                                                   # [n, W]
        pos = np.where(real, start[:, None] + j, 0)                             # [n, W]
        width = min(-(-int((start + q).max()) // block_size), block_table.shape[1])
        tables = block_table[slots.astype(np.int64), :width]                    # [n, width]
        blk = tables[np.arange(n)[:, None], np.minimum(pos // block_size, width - 1)]
        slot_map = np.where(real, blk.astype(np.int64) * block_size + pos % block_size, -1)
        pad = (b - n) * w
        flat_real = np.flatnonzero(real.reshape(-1))                            # [T]
        i64 = np.concatenate([pos.reshape(-1), np.zeros(pad, np.int64), slot_map.reshape(-1),
                              np.full(pad, -1, np.int64), flat_real,
                              np.zeros(b * w - flat_real.size, np.int64)])
        seq = np.concatenate([start + w, np.zeros(b - n, np.int64)]).astype(np.int32)
        i32 = np.concatenate([seq, tables.reshape(-1).astype(np.int32)])
        dev = self.positions.device
        return VerifyInputs(b, to_device(i64, dev), to_device(i32, dev), int(flat_real.size), n,
                            width)

    def run(self, vin: VerifyInputs, input_ids: torch.Tensor | None = None,   # type: ignore[override]
            hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Replay the bucket of a verify step (``T`` real tokens in, ``T`` rows out).

        Args:
            vin: from :meth:`inputs`. input_ids: ``[T]`` (first stage); hidden, residual:
                ``[T, H]`` (later stages), compact layout.
        Returns:
            logits ``[T, V]`` fp32 at every real token (last stage) or ``(hidden, residual)``
            ``[T, H]`` each, compact; fresh tensors (gathered from the graph's outputs).
        """
        b, w, t = vin.bucket, self.w, vin.num_tokens
        bw = b * w
        self.positions[:bw].copy_(vin.i64[:bw])
        self.slot_mapping[:bw].copy_(vin.i64[bw:2 * bw])
        real = vin.i64[2 * bw:2 * bw + t]
        self.seq_lens[:b].copy_(vin.i32[:b])
        self.block_tables[:vin.num_rows, :vin.width].copy_(
            vin.i32[b:].view(vin.num_rows, vin.width))
        if input_ids is not None:
            self.input_ids.index_copy_(0, real, input_ids)
        if hidden is not None:
            self.hidden.index_copy_(0, real, hidden)
            self.residual.index_copy_(0, real, residual)
        if b in self.graphs:
            self.graphs[b].replay()
            out = self.outputs[b]
        else:   # not captured (CPU tests): the same padded step, eagerly
            out = self._run(b)
        if isinstance(out, tuple):
            return out[0].index_select(0, real), out[1].index_select(0, real)
        return out.index_select(0, real)
