"""Mirror validation off the critical path (invariant 4 checked every step without a host sync).

After a step, :meth:`AsyncMirrorCheck.snapshot` issues non-blocking copies of the device fields
(``MIRROR_FIELDS`` of :class:`~runtime.worker.device_state.DeviceState`) into pinned host memory,
records a CUDA event, and keeps a copy of the CPU mirror as it was at that moment. The comparison
runs when the event has completed: :meth:`poll` checks it opportunistically, and the next
:meth:`snapshot` forces it, so a divergence is reported at the latest one step after it happened.
A divergence raises :class:`~ppstate.errors.MirrorDivergence` naming rank, step, slot, request,
field and both values (via ``CpuMirror.validate``), exactly as the synchronous check does.

On the CPU (no events) the copy is synchronous and the comparison immediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ppstate.mirror import MIRROR_FIELDS, CpuMirror


@dataclass
class _Pending:
    step: int
    buf: int                       # index of the pinned buffer set in use
    expected: CpuMirror            # the mirror as it was at snapshot time
    live: np.ndarray               # [num_live] slots compared
    owners: list                   # [max_num_reqs] req ids at snapshot time
    event: object | None


class AsyncMirrorCheck:
    """Double-buffered async snapshots of one rank's device fields.

    Args:
        state: the rank's DeviceState (device tensors ``[max_num_reqs]`` int64, ``mirror``,
            ``owner``, ``live_slots()``).
    """

    def __init__(self, state) -> None:
        self.state = state
        m = state.mirror.num_computed_tokens_np.shape[0]
        pin = state.device.type == "cuda"
        self.host = [{f: torch.empty(m, dtype=torch.int64, pin_memory=pin) for f in MIRROR_FIELDS}
                     for _ in range(2)]                                   # 2 x field -> [m]
        self.pending: list[_Pending] = []
        self.checked_steps = 0

    def snapshot(self, step: int) -> None:
        """Start the check of ``step`` (call after the step's post-update was issued). Finishes
        the previous step's check first (blocking on its copy if still in flight).

        Raises:
            MirrorDivergence: from the previous step's (or, on CPU, this step's) comparison.
        """
        self.poll(block=True)
        live = self.state.live_slots()
        if live.size == 0:
            return
        k = step % 2
        for f in MIRROR_FIELDS:
            self.host[k][f].copy_(getattr(self.state, f), non_blocking=True)
        event = None
        if self.state.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        mirror = self.state.mirror
        expected = CpuMirror(mirror.num_computed_tokens_np.shape[0], rank=mirror.rank)
        for f in MIRROR_FIELDS:
            np.copyto(expected.array(f), mirror.array(f))
        self.pending.append(_Pending(step, k, expected, live, list(self.state.owner), event))
        if event is None:
            self.poll(block=True)

    def poll(self, block: bool = False) -> None:
        """Compare every pending snapshot whose copy has completed (all of them with ``block``)."""
        while self.pending:
            p = self.pending[0]
            if p.event is not None:
                if not block and not p.event.query():
                    return
                p.event.synchronize()
            self.pending.pop(0)
            dev = {f: self.host[p.buf][f].numpy() for f in MIRROR_FIELDS}
            self.checked_steps += 1
            p.expected.validate(dev, p.live, p.step, owners=p.owners)
            p.expected.validate_blocks(self.state.block_size, p.live, p.step, owners=p.owners,
                                       spec_slack=2 * (self.state.width - 1))
