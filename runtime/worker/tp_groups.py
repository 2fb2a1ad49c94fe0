"""torch.distributed groups of one rank when every pipeline stage is run by a tensor-parallel (TP)
group (docs/tp.md), taken from a ``DeviceMesh`` with dimensions ``("pp", "tp")``.

``pp x tp`` processes; global rank ``g = pp_rank * tp + tp_rank`` (the mesh is
``arange(pp * tp).view(pp, tp)``, row-major: a stage's TP ranks are consecutive, so
``torchrun --nproc-per-node tp`` puts a stage on one machine). Each rank is in:

* its **TP group** ``mesh["tp"].get_group()`` = ``{s * tp + r : r}`` (stage ``s``): the
  all-reduces and the logits all-gather inside the stage's forward
  (:class:`runtime.model.tp.comm.TPComm`);
* its **PP chain** ``mesh["pp"].get_group()`` = ``{s * tp + r : s}`` (TP rank ``r`` of every
  stage): the hidden-state hand-off from stage ``s`` TP rank ``r`` to stage ``s + 1`` TP rank ``r``;
  and a **sibling broadcast group** over the same ranks (a second ``new_group``; a mesh has one
  group per dimension) for the last stage's TP rank ``r`` sampled-token broadcast to TP rank ``r``
  of every earlier stage. Every TP rank of the last stage samples the same ids
  (:mod:`runtime.model.tp.stage`), so each chain carries its own copy and no message crosses chains.

The mesh is built on the world this module initialises (``DeviceMesh(...)`` over an existing
default group, not ``init_device_mesh``, which would rendezvous through ``env://`` only); its
groups get the step timeout through ``backend_override`` options. Group creation is collective over
the world: every rank builds the mesh and every sibling group, in the same order. The backend
follows :func:`runtime.worker.groups.init_groups`: NCCL with one GPU per rank, else gloo (host
staging on a shared GPU; the mesh's device type is then ``cpu``, where the collectives' tensors are).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.worker.groups import PPGroups

MESH_DIMS = ("pp", "tp")


def layout(pp_size: int, tp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(tp_groups, chains)``: global ranks of each stage's TP group ``[pp][tp]`` (the mesh's
    rows) and of each TP rank's pipeline chain ``[tp][pp]`` (its columns)."""
    mesh = mesh_ranks(pp_size, tp_size)
    return mesh.tolist(), mesh.t().tolist()


def mesh_ranks(pp_size: int, tp_size: int) -> torch.Tensor:
    """``[pp_size, tp_size]`` int tensor of global ranks, row-major (``g = pp * tp_size + tp``)."""
    return torch.arange(pp_size * tp_size).view(pp_size, tp_size)


def _options(backend: str, timeout: timedelta):
    """Process-group options carrying ``timeout`` for the mesh's groups (None: torch's default)."""
    cls = dist.ProcessGroupGloo if backend == "gloo" else getattr(dist, "ProcessGroupNCCL", None)
    make = getattr(cls, "_Options", None) or getattr(cls, "Options", None)
    if make is None:
        return None
    opts = make()
    opts._timeout = timeout
    return opts


def build_mesh(pp_size: int, tp_size: int, backend: str, device_type: str,
               timeout: timedelta) -> DeviceMesh:
    """The ``("pp", "tp")`` DeviceMesh over the initialised world (collective: every rank calls
    it). ``device_type``: where the collectives' tensors live (``cpu`` under gloo)."""
    opts = _options(backend, timeout)
    return DeviceMesh(device_type, mesh_ranks(pp_size, tp_size), mesh_dim_names=MESH_DIMS,
                      backend_override=((backend, opts), (backend, opts)))


def init_tp_groups(rank: int, pp_size: int, tp_size: int, init_method: str, device: torch.device,
                   timeout_s: float) -> PPGroups:
    """Initialise torch.distributed over ``pp_size x tp_size`` ranks and build this rank's groups.

    Args:
        rank: global rank (``pp_rank * tp_size + tp_rank``).
        Others as :func:`runtime.worker.groups.init_groups`.
    Returns:
        :class:`PPGroups` with ``rank`` = the PP rank, ``chain`` = the global ranks of its PP chain,
        ``tp_rank`` / ``tp_size`` / ``tp_group`` / ``mesh`` set.
    Raises:
        RuntimeError: rendezvous failed or timed out; the mesh disagrees with the rank layout.
    """
    world = pp_size * tp_size
    pp_rank, tp_rank = divmod(rank, tp_size)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    multi_gpu = device.type == "cuda" and torch.cuda.device_count() >= ranks_here
    backend = "nccl" if multi_gpu else "gloo"
    timeout = timedelta(seconds=timeout_s)
    stage_on_host = device.type == "cuda" and backend == "gloo"
    eager = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timeout, **eager)
    mesh = build_mesh(pp_size, tp_size, backend, "cpu" if device.type != "cuda" or stage_on_host
                      else "cuda", timeout)
    if tuple(mesh.get_coordinate() or ()) != (pp_rank, tp_rank):
        raise RuntimeError(f"rank {rank}: DeviceMesh coordinate {mesh.get_coordinate()} is not "
                           f"(pp {pp_rank}, tp {tp_rank})")
    chain = tuple(mesh["pp"].mesh.tolist())
    groups = PPGroups(rank=pp_rank, pp_size=pp_size, backend=backend, device=device,
                      timeout=timeout, stage_on_host=stage_on_host, chain=chain, tp_rank=tp_rank,
                      tp_size=tp_size, mesh=mesh)
    groups.tp_group, groups.pp_group = mesh["tp"].get_group(), mesh["pp"].get_group()
    for r, members in enumerate(layout(pp_size, tp_size)[1]):   # every chain's sibling, in order
        bcast = dist.new_group(members, backend=backend, timeout=timeout)
        if r == tp_rank:
            groups.bcast_group = bcast
    return groups
