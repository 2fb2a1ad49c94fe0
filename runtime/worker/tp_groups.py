"""torch.distributed groups of one rank when every pipeline stage is run by a tensor-parallel (TP)
group (docs/tp.md).

``pp x tp`` processes; global rank ``g = pp_rank * tp + tp_rank`` (a stage's TP ranks are
consecutive, so ``torchrun --nproc-per-node tp`` puts a stage on one machine). Each rank is in:

* its **TP group** ``{s * tp + r : r}`` (stage ``s``): the all-reduces and the logits all-gather
  inside the stage's forward (:class:`runtime.model.tp.comm.TPComm`);
* its **PP chain** ``{s * tp + r : s}`` (TP rank ``r`` of every stage), twice: the PP group for
  the hidden-state hand-off from stage ``s`` TP rank ``r`` to stage ``s + 1`` TP rank ``r``, and the
  sibling broadcast group for the last stage's TP rank ``r`` sampled-token broadcast to TP rank
  ``r`` of every earlier stage. Every TP rank of the last stage samples the same ids
  (:mod:`runtime.model.tp.stage`), so each chain carries its own copy and no message crosses chains.

``new_group`` is collective over the world: every rank creates every group, in the same order.
The backend follows :func:`runtime.worker.groups.init_groups`: NCCL with one GPU per rank, else gloo
(host staging on a shared GPU).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.worker.groups import PPGroups


def layout(pp_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(tp_groups, chains)``: global ranks of each stage's TP group ``[pp][tp]`` and of each TP
    rank's pipeline chain ``[tp][pp]``."""
    tp_groups = [[s * tp_size + r for r in range(tp_size)] for s in range(pp_size)]
    chains = [[s * tp_size + r for s in range(pp_size)] for r in range(tp_size)]
    return tp_groups, chains


def init_tp_groups(rank: int, pp_size: int, tp_size: int, init_method: str, device: torch.device,
                   timeout_s: float) -> PPGroups:
    """Initialise torch.distributed over ``pp_size x tp_size`` ranks and build this rank's groups.

    Args:
        rank: global rank (``pp_rank * tp_size + tp_rank``).
        Others as :func:`runtime.worker.groups.init_groups`.
    Returns:
        :class:`PPGroups` with ``rank`` = the PP rank, ``chain`` = the global ranks of its PP chain,
        ``tp_rank`` / ``tp_size`` / ``tp_group`` set.
    Raises:
        RuntimeError: rendezvous failed or timed out.
    """
    world = pp_size * tp_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    multi_gpu = device.type == "cuda" and torch.cuda.device_count() >= ranks_here
    backend = "nccl" if multi_gpu else "gloo"
    timeout = timedelta(seconds=timeout_s)
    tp_groups, chains = layout(pp_size, tp_size)
    groups = PPGroups(rank=pp_rank, pp_size=pp_size, backend=backend, device=device,
                      timeout=timeout, stage_on_host=(device.type == "cuda" and backend == "gloo"),
                      chain=tuple(chains[tp_rank]), tp_rank=tp_rank, tp_size=tp_size)
    eager = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout, **eager)
    for s, members in enumerate(tp_groups):
        g = dist.new_group(members, backend=backend, timeout=timeout)
        if s == pp_rank:
            groups.tp_group = g
    for r, members in enumerate(chains):
        pp_g = dist.new_group(members, backend=backend, timeout=timeout)
        bc_g = dist.new_group(members, backend=backend, timeout=timeout)
        if r == tp_rank:
            groups.pp_group, groups.bcast_group = pp_g, bc_g
    return groups
