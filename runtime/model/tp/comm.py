"""The collectives of one stage's tensor-parallel (TP) group: the all-reduce that sums the partial
outputs of the row-parallel layers (O, down, vocab-parallel embedding) and the all-gather that
joins the vocab-parallel logits.

Both run synchronously on the TP group (every TP rank of the stage calls them in the same order:
they are inside the stage's forward, which every TP rank runs on the same batch). With NCCL they
take device tensors; with gloo on a CUDA device (several ranks on one GPU) the tensors are staged
through host memory. On the CPU with gloo they run in place on the CPU tensors.

Floating-point sums are taken by the backend in one fixed order, the same bits on every TP rank
(ring reduce-scatter then all-gather), so the TP ranks' hidden states stay bitwise equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TPComm:
    """A TP group's collectives.

    Args:
        group: the ``torch.distributed`` process group of this stage's TP ranks (None: size 1).
        size: TP ranks in the group. rank: this rank's index in it.
        stage_on_host: copy tensors to host memory around each call (CUDA tensors, gloo group).
        device: where the group's tensors live (the CUDA device for NCCL, else the CPU).
    """

    def __init__(self, group, size: int, rank: int, stage_on_host: bool = False,
                 device: torch.device | str = "cpu") -> None:
        self.group, self.size, self.rank, self.stage_on_host = group, size, rank, stage_on_host
        self.device = torch.device(device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the TP ranks (same shape and dtype); ``x`` itself may be reused."""
        if self.size == 1:
            return x
        t = x.to("cpu") if self.stage_on_host else x.contiguous()
        dist.all_reduce(t, group=self.group)
        return t.to(x.device) if self.stage_on_host else t

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, C]`` of every TP rank joined along columns in rank order: ``[R, size * C]``."""
        if self.size == 1:
            return x
        t = x.to("cpu") if self.stage_on_host else x.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        out = torch.cat(parts, dim=-1)
        return out.to(x.device) if self.stage_on_host else out

    def broadcast_seed(self) -> int:
        """TP rank 0's ``torch.initial_seed()``, seeded into every TP rank's generators, so the
        unseeded sampling draws are the same on every TP rank of the last stage."""
        seed = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64,
                            device=self.device)
        if self.size > 1:
            dist.broadcast(seed, src=dist.get_global_rank(self.group, 0), group=self.group)
        torch.manual_seed(int(seed))
        return int(seed)
