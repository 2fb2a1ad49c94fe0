"""Piecewise CUDA graphs of a TP rank's decode steps when its TP group is gloo (several TP ranks
sharing one GPU, tensors staged through host memory; docs/tp.md).

A gloo collective runs on the host, so it cannot be inside a captured graph. A decode step of a
:class:`~runtime.model.tp.paged.TPPagedStage` is therefore captured as the segments between its
collectives (vLLM's piecewise graphs, split at the all-reduces instead of at attention):

    [embedding] AR [attn + O] AR [MLP] AR [attn + O] AR ... [MLP] AR [norm + LM head] AG

(``AR``: all-reduce, ``AG``: the logits all-gather; the first segment only on the first stage, the
last only on the last stage; ``2 L + 1`` collectives on a first stage of ``L`` layers). At replay
each segment's graph is replayed and the collective after it runs eagerly on that segment's static
output: the all-reduce writes its sum back into the same tensor, which the next segment's graph
reads. Each collective operand is a tensor of the shared graph pool kept alive by the recorded
collective list, so its address is the one the next segment was captured with.

With NCCL (one GPU per rank) the collectives can be captured, and the worker uses the whole-step
:class:`~runtime.worker.cuda_graphs.DecodeGraphs` instead; this module is only for gloo.
"""

from __future__ import annotations

import warnings

import torch

from runtime.worker.cuda_graphs import DecodeGraphs


class _Pieces:
    """The recorded decode step of one bucket: ``graphs[i]`` then ``ops[i]`` (a collective on a
    static tensor), for every ``i``; ``output`` the last graph's output (non-last stages)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.ops: list[tuple[str, torch.Tensor]] = []
        self.output = None
        self._open: torch.cuda.CUDAGraph | None = None

    # ---- capture: the stage calls these in place of its TPComm ---------------------------------
    def begin(self) -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool)
        self._open = g

    def end(self, keep: bool = True) -> None:
        g, self._open = self._open, None
        if keep:
            g.capture_end()
            self.graphs.append(g)
        else:   # the trailing segment of a non-last stage is empty: torch warns, we drop it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                g.capture_end()
        self.pool = g.pool() if self.pool is None else self.pool

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Close the segment producing ``x``; the sum is written back into ``x`` at replay."""
        self.end()
        self.ops.append(("reduce", x))
        self.begin()
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """Close the last segment (it produced the local logits ``x``); gathered at replay."""
        self.end()
        self.ops.append(("gather", x))
        return x

    def finish(self, out) -> None:
        """After the stage's forward returned ``out``: close a still-open (empty) segment."""
        if self._open is not None:
            self.end(keep=False)
        self.output = out

    # ---- replay ---------------------------------------------------------------------------
    def replay(self, comm, vocab_size: int):
        """Replay every segment with its collective after it (``comm``: the TP group). Returns
        the step's output: ``(hidden, residual)`` (static) or the gathered logits ``[b, V]``."""
        out = self.output
        for i, g in enumerate(self.graphs):
            g.replay()
            if i < len(self.ops):
                kind, t = self.ops[i]
                if kind == "reduce":
                    t.copy_(comm.all_reduce(t))
                else:
                    out = comm.all_gather_cols(t)[:, :vocab_size]
        return out


class PiecewiseDecodeGraphs(DecodeGraphs):
    """:class:`DecodeGraphs` of a :class:`~runtime.model.tp.paged.TPPagedStage` over a gloo TP
    group: per bucket the segments between the collectives (module doc). Same arguments, buffers,
    buckets and :meth:`run` as :class:`DecodeGraphs`; ``graphs[b]`` is the bucket's pieces.

    Every TP rank of a stage must capture the same buckets (the warm-up of each bucket runs its
    collectives eagerly); the capture itself runs none.
    """

    piecewise = True   # the worker captures no whole-step verify graphs next to these

    def _capture_bucket(self, b: int) -> None:
        model = self.model
        rec = _Pieces(self.pool)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        model.collectives = rec
        try:
            with torch.cuda.stream(stream):
                rec.begin()
                out = self._run(b)
                rec.finish(out)
        finally:
            model.collectives = model.comm
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = rec.pool
        self.graphs[b] = rec

    def _replay(self, b: int):
        return self.graphs[b].replay(self.model.comm, self.model.vocab_size)

    @property
    def num_segments(self) -> dict[int, int]:
        """Captured graphs per bucket: 2 per layer, 1 more for the embedding on the first stage and
        1 more for the norm and LM head on the last."""
        return {b: len(p.graphs) for b, p in self.graphs.items()}


def fast_path_classes(tp_comm, nccl: bool):
    """``(stage class, decode-graph class)`` of a CUDA rank's fast path: without TP
    ``PagedStage`` / ``DecodeGraphs``; under TP ``TPPagedStage`` with whole-step graphs holding
    the NCCL collectives, or with :class:`PiecewiseDecodeGraphs` over a gloo TP group."""
    from runtime.model.paged_stage import PagedStage
    if tp_comm is None:
        return PagedStage, DecodeGraphs
    from runtime.model.tp.paged import TPPagedStage
    return TPPagedStage, (DecodeGraphs if nccl else PiecewiseDecodeGraphs)
