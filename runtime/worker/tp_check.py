"""Agreement of a stage's tensor-parallel (TP) ranks on the token ids they hold (docs/tp.md).

Every TP rank keeps its own device state; its mirrors are validated against it every step like any
rank's. What the mirrors do not hold are the token ids themselves (``all_token_ids``, written by each
TP rank's own sampling on the last stage and by the deferred receive elsewhere). On a validated step
the TP ranks of a stage therefore compare one digest per slot of ``all_token_ids[slot, :total_len]``
(all-gather of ``[max_num_reqs]`` int64 on the TP group) and raise a :class:`TPDivergence` naming
the stage, the TP rank that differs from TP rank 0, the step, the slot and the field.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TPDivergence(RuntimeError):
    """TP ranks of one stage hold different token ids for a slot (names pp rank, tp rank, step,
    slot, field)."""


def slot_digests(all_token_ids: torch.Tensor, total_len: torch.Tensor) -> torch.Tensor:
    """``[max_num_reqs]`` int64: per slot, the sum of ``token * (position + 1)`` over the positions
    ``< total_len`` (int64 arithmetic, wrapping)."""
    pos = torch.arange(all_token_ids.shape[1], device=all_token_ids.device)
    live = pos[None, :] < total_len[:, None]
    return (all_token_ids * (pos + 1)[None, :] * live).sum(1)


def check_tp_agreement(comm, all_token_ids: torch.Tensor, total_len: torch.Tensor, step: int,
                       pp_rank: int) -> None:
    """Compare this TP rank's slot digests with every TP rank's of the stage (a collective: every
    TP rank of the stage calls it for the same steps).

    Raises:
        TPDivergence: a TP rank's digest of a slot differs from TP rank 0's.
    """
    mine = slot_digests(all_token_ids, total_len).to(comm.device if not comm.stage_on_host else "cpu")
    parts = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(parts, mine, group=comm.group)
    ref = parts[0].cpu()
    for r, p in enumerate(parts[1:], start=1):
        bad = torch.nonzero(p.cpu() != ref).flatten()
        if bad.numel():
            raise TPDivergence(f"pp rank {pp_rank} step {step}: tp rank {r} holds other "
                               f"all_token_ids than tp rank 0 for slot {int(bad[0])}")
