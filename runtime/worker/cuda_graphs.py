"""CUDA graphs of decode-only steps, one per batch-size bucket (vLLM's piecewise-free "full
decode graph" scheme; PyTorch ``torch.cuda.CUDAGraph``).

A decode-only step has one query per row, so every shape is fixed by the row count. We capture
:meth:`PagedStage.forward` once per bucket (1, 2, 4, 8, 16, 24, 32, 40, ... up to
``max_num_seqs``) over static input buffers; at run time a step of ``n`` rows copies its metadata
into the first ``n`` rows of the buffers, marks the remaining rows of its bucket as padding
(``slot_mapping`` -1: no KV write; ``seq_len`` 0: no attention; position 0) and replays the
bucket's graph. Prefill and mixed steps run eagerly. Graphs share one memory pool and are captured
largest first, so the pool is sized by the largest bucket.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from runtime.model.kernels.attention import choose_num_splits
from runtime.model.paged_stage import PagedMeta, PagedStage


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (included, even if not a
    multiple of 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


@dataclass
class CaptureReport:
    """What capture cost: ``seconds`` wall, ``bytes`` of graph memory pool (device)."""
    buckets: list[int]
    seconds: float
    bytes: int


class DecodeGraphs:
    """Captured decode steps of one :class:`PagedStage`.

    Args:
        model: the stage (first stage takes token ids, later stages hidden + residual).
        max_num_seqs: largest decode batch (rows).
        max_blocks_per_seq: block-table width MB (= ceil(max_model_len / block_size)).
        max_model_len: longest context, fixes the split-K choice of each bucket.
    """

    def __init__(self, model: PagedStage, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int) -> None:
        self.model, self.buckets = model, bucket_sizes(max_num_seqs)
        dev = model.kv_cache.device
        n, cfg = self.buckets[-1], model.cfg
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(n, **i64)                            # [n]
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=model.kv_cache.dtype, device=dev)
        self.residual = torch.zeros_like(self.hidden)                     # [n, H]
        self.positions = torch.zeros(n, **i64)                            # [n]
        self.slot_mapping = torch.full((n,), -1, **i64)                   # [n]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)     # [n, MB]
        self.seq_lens = torch.zeros(n, **i32)                             # [n]
        self.query_start_loc = torch.arange(n + 1, **i32)                 # [n + 1], fixed
        self.logits_indices = torch.arange(n, **i64)                      # [n], fixed
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        self.pool = None

    def _meta(self, b: int) -> PagedMeta:
        splits = choose_num_splits(b, self.model.cfg.num_kv_heads, self.max_model_len)
        return PagedMeta(self.positions[:b], self.slot_mapping[:b], self.block_tables[:b],
                         self.seq_lens[:b], self.query_start_loc[:b + 1], self.logits_indices[:b],
                         max_query_len=1, num_splits=splits)

    def _run(self, b: int):
        if self.model.stage.is_first:
            return self.model.forward(self._meta(b), input_ids=self.input_ids[:b])
        return self.model.forward(self._meta(b), hidden=self.hidden[:b], residual=self.residual[:b])

    def capture(self, progress: bool = True) -> CaptureReport:
        """Capture every bucket (largest first). Padding rows only: nothing is written to the
        cache. Returns the wall seconds and the device memory taken meanwhile (free memory
        before minus after, so it includes Triton's compiled kernels and cuBLAS workspaces)."""
        # Free memory is measured process-wide, and every torch.cuda.graph capture empties the
        # allocator's cache on entry: garbage still awaiting the cycle collector (a previous
        # model's tensors) would be released to the driver during capture and make the figure
        # negative. Collect it and empty the cache first.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        side = torch.cuda.Stream()
        it = sorted(self.buckets, reverse=True)
        if progress:
            from tqdm.auto import tqdm
            it = tqdm(it, desc="capturing CUDA graphs", unit="graph")
        for b in it:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._run(b)                       # warm-up: Triton compiles, allocator settles
            torch.cuda.current_stream().wait_stream(side)
            self._capture_bucket(b)
        torch.cuda.synchronize()
        return CaptureReport(sorted(self.buckets), time.perf_counter() - t0,
                             before - torch.cuda.mem_get_info()[0])

    def _capture_bucket(self, b: int) -> None:
        """Capture bucket ``b``'s step as one graph in the shared pool (after its warm-up)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[b] = self._run(b)
        self.pool = g.pool() if self.pool is None else self.pool
        self.graphs[b] = g

    def _replay(self, b: int):
        """Replay bucket ``b`` (inputs already in the static buffers); its full-bucket output."""
        self.graphs[b].replay()
        return self.outputs[b]

    def bucket_for(self, rows: int) -> int | None:
        """Smallest captured bucket holding ``rows`` rows, or None (run eagerly)."""
        for b in self.buckets:
            if b >= rows:
                return b if b in self.graphs else None
        return None

    def run(self, meta: PagedMeta, input_ids: torch.Tensor | None = None,
            hidden: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """Replay the bucket of a decode-only step of ``n = len(meta.seq_lens)`` rows.

        Copies the step's tensors into the static buffers (device-to-device, no host sync), pads
        rows ``n..bucket`` and replays. Returns the first ``n`` rows of the output: logits
        ``[n, V]`` (last stage) or ``(hidden, residual)`` ``[n, H]`` each. The returned tensors are
        the graph's static outputs: read them before the next :meth:`run`.

        Raises:
            ValueError: not a decode-only step, or no bucket holds ``n`` rows.
        """
        n = int(meta.seq_lens.shape[0])
        b = self.bucket_for(n)
        if meta.max_query_len != 1 or b is None:
            raise ValueError(f"no CUDA graph for {n} rows with max_query_len {meta.max_query_len}")
        mb = meta.block_tables.shape[1]
        self.positions[:n].copy_(meta.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :mb].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if b > n:
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()
            self.positions[n:b].zero_()
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids)
        if hidden is not None:
            self.hidden[:n].copy_(hidden)
            self.residual[:n].copy_(residual)
        out = self._replay(b)
        if isinstance(out, tuple):
            return out[0][:n], out[1][:n]
        return out[:n]
