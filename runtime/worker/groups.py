"""torch.distributed setup for one PP rank: the PP group for hidden-state p2p and a sibling
broadcast group (same ranks, second ``new_group``) for the last rank's sampled-token broadcast, so
the two kinds of traffic never serialise behind each other (vLLM ``make_sibling_device_group``).

On CPU both groups use gloo. On CUDA with one process per GPU they use NCCL; several ranks on one
GPU (NCCL refuses "Duplicate GPU") use gloo with explicit host staging of every tensor.

With NCCL the communicators are created eagerly at startup (``init_process_group(device_id=...)``;
no lazy per-op communicator on the first send), hidden states travel by ``batch_isend_irecv`` on
the PP group, and the sampled-token broadcast is issued from a side CUDA stream on the sibling
group, ordered after the compute stream by an event: the compute stream never waits for it, and a
receiver's ``work.wait()`` makes only its compute stream (not its host thread) wait.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class PPGroups:
    """The rank's view of the pipeline.

    Attributes:
        rank: this PP rank (0..pp_size-1), equal to the global rank here.
        pp_size: number of stages.
        backend: ``gloo`` or ``nccl``.
        device: where the stage computes.
        timeout: limit on every wait (collective, p2p receive).
        stage_on_host: copy tensors to host memory around gloo calls (CUDA + gloo).
        chain: global ranks of this rank's pipeline, by PP rank (None: the PP ranks themselves);
            with tensor parallelism the TP rank r of every stage (docs/tp.md).
        tp_rank, tp_size, tp_group: this rank's place in its stage's TP group
            (:mod:`runtime.worker.tp_groups`); size 1 and no group without TP.
        mesh: the ``torch.distributed`` ``DeviceMesh`` with dimensions ``("pp", "tp")`` the TP
            and PP groups come from (``mesh["tp"].get_group()``, ``mesh["pp"].get_group()``);
            None without TP (the PP groups are then two ``new_group`` over the world).
    """
    rank: int
    pp_size: int
    backend: str
    device: torch.device
    timeout: timedelta
    stage_on_host: bool = False
    pp_group: object | None = None
    bcast_group: object | None = None
    chain: tuple[int, ...] | None = None
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object | None = None
    mesh: object | None = None
    _pending_sends: list = field(default_factory=list)
    _side_stream: object | None = None

    @property
    def nccl(self) -> bool:
        """True when the groups are NCCL (device tensors, stream-ordered waits)."""
        return self.backend == "nccl"

    def side_stream(self):
        """The CUDA stream the sampled-token broadcast is issued from (created once)."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        return self._side_stream

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.pp_size - 1

    @property
    def last_rank(self) -> int:
        return self.pp_size - 1

    def peer(self, pp_rank: int) -> int:
        """Global rank of PP rank ``pp_rank`` of this rank's pipeline (same TP rank)."""
        return pp_rank if self.chain is None else self.chain[pp_rank]

    def comm_device(self) -> torch.device:
        """Device of the tensors handed to torch.distributed."""
        return torch.device("cpu") if self.stage_on_host else self.device

    def send_next(self, tensor: torch.Tensor) -> None:
        """Non-blocking send of ``tensor`` to rank + 1 on the PP group.

        The tensor is kept alive until its send completes; at most ``keep`` sends stay pending.
        """
        t = tensor.to("cpu") if self.stage_on_host else tensor.contiguous()
        if self.nccl:
            op = dist.P2POp(dist.isend, t, self.peer(self.rank + 1), group=self.pp_group)
            work = dist.batch_isend_irecv([op])[0]
        else:
            work = dist.isend(t, dst=self.peer(self.rank + 1), group=self.pp_group)
        self._pending_sends.append((work, t))
        while len(self._pending_sends) > 4:
            self._wait(self._pending_sends.pop(0)[0])

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Blocking receive of a ``shape`` tensor from rank - 1 (bounded by ``timeout``)."""
        buf = torch.empty(shape, dtype=dtype, device=self.comm_device())
        if self.nccl:  # stream-ordered: the compute stream waits, the host does not
            op = dist.P2POp(dist.irecv, buf, self.peer(self.rank - 1), group=self.pp_group)
            dist.batch_isend_irecv([op])[0].wait()
            return buf
        self._wait(dist.irecv(buf, src=self.peer(self.rank - 1), group=self.pp_group))
        return buf.to(self.device) if self.stage_on_host else buf

    def post_broadcast(self, buf: torch.Tensor):
        """Start the sampled-token broadcast from the last rank on the sibling group.

        Returns:
            (work, host_or_device_buffer): on non-last ranks the buffer fills when work completes.
        """
        t = buf.to("cpu") if self.stage_on_host else buf
        if not self.nccl:
            work = dist.broadcast(t, src=self.peer(self.last_rank), group=self.bcast_group,
                                  async_op=True)
            return work, t
        ready = torch.cuda.Event()
        ready.record()                               # after whatever produced / will consume t
        side = self.side_stream()
        with torch.cuda.stream(side):
            side.wait_event(ready)
            t.record_stream(side)
            work = dist.broadcast(t, src=self.peer(self.last_rank), group=self.bcast_group,
                                  async_op=True)
        return work, t

    def keep_pending(self, work, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` alive until ``work`` (a posted broadcast) completes; waited lazily
        together with the p2p sends."""
        self._pending_sends.append((work, tensor))

    def wait(self, work) -> None:
        """Wait for ``work`` at most ``timeout``; raises RuntimeError (timeout) from torch."""
        self._wait(work)

    def _wait(self, work) -> None:
        if self.backend == "gloo":
            work.wait(self.timeout)
        else:
            work.wait()

    def drain(self) -> None:
        """Wait for all pending sends (before shutdown)."""
        while self._pending_sends:
            self._wait(self._pending_sends.pop(0)[0])


def init_groups(rank: int, pp_size: int, init_method: str, device: torch.device,
                timeout_s: float) -> PPGroups:
    """Initialise torch.distributed for one rank and create the PP and sibling groups (without TP;
    with TP the worker calls :func:`runtime.worker.tp_groups.init_tp_groups`).

    Args:
        rank: this process's rank.
        pp_size: world size (= pipeline stages).
        init_method: rendezvous URL, e.g. ``tcp://127.0.0.1:29511`` or ``env://`` under torchrun.
        device: compute device of this rank.
        timeout_s: seconds before any collective / receive fails.

    Raises:
        RuntimeError: rendezvous failed or timed out.
    """
    # NCCL needs one GPU per rank on each host: under torchrun the ranks of this host are
    # LOCAL_WORLD_SIZE, with the spawn launcher all pp_size ranks share this host.
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", pp_size))
    multi_gpu = device.type == "cuda" and torch.cuda.device_count() >= ranks_here
    backend = "nccl" if multi_gpu else "gloo"
    timeout = timedelta(seconds=timeout_s)
    groups = PPGroups(rank=rank, pp_size=pp_size, backend=backend, device=device, timeout=timeout,
                      stage_on_host=(device.type == "cuda" and backend == "gloo"))
    if pp_size == 1:
        return groups
    eager = {"device_id": device} if backend == "nccl" else {}  # communicators built now
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=pp_size,
                            timeout=timeout, **eager)
    ranks = list(range(pp_size))
    groups.pp_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    groups.bcast_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    return groups


def destroy_groups(groups: PPGroups) -> None:
    """Drain pending sends and tear the process group down (best effort)."""
    if (groups.pp_size == 1 and groups.tp_size == 1) or not dist.is_initialized():
        return
    try:
        groups.drain()
    finally:
        dist.destroy_process_group()
