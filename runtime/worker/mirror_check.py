"""Mirror validation off the critical path (invariant 4 checked every step without a host sync).

After a step, :meth:`AsyncMirrorCheck.snapshot` issues one non-blocking copy into pinned host
memory of everything checked, flat (:mod:`runtime.worker.state_check`): the device fields
(``MIRROR_FIELDS`` of :class:`~runtime.worker.device_state.DeviceState`, rows of one buffer),
``total_len``, the block-table rows and the sampling tables; records a CUDA event; and writes the
host copies of the expected values, as they are at that moment, in the same layout. The
comparison is one equality of the two flat arrays and one vectorised test of the KV block counts
over the live slots; only when
it fails is the first divergent (field, slot) looked up for the error. The comparison
runs when the event has completed: :meth:`poll` checks it opportunistically, and the next
:meth:`snapshot` forces it, so a divergence is reported at the latest one step after it happened.
A divergence raises :class:`~ppstate.errors.MirrorDivergence` naming rank, step, slot, request,
field and both values (via ``CpuMirror.validate``), exactly as the synchronous check does.

On the CPU (no events) the copy is synchronous and the comparison immediate.

When tracing, each snapshot records its ``mirror.check`` event at the place the synchronous check
would (``JsonlSink.emit_when``: the sink holds it, and the rank's later events, until the
comparison has run), with the verdict of that comparison, so a GPU run's trace replays like a
CPU run's (docs/trace_format.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ppstate.errors import MirrorDivergence
from ppstate.events import NULL_SINK, EventSink
from ppstate.mirror import MIRROR_FIELDS, CpuMirror
from runtime.worker import state_check


def m_slots(state) -> int:
    """Slots of ``state`` (``max_num_reqs``)."""
    return state.block_table_np.shape[0]


@dataclass
class _Pending:
    step: int
    buf: int                       # index of the double-buffered host / expected arrays in use
    live: np.ndarray               # [num_live] slots compared
    owners: list                   # [max_num_reqs] req ids at snapshot time
    event: object | None
    cols: int = 1                  # block-table columns in the flat copy
    verdict: tuple[bool, str | None] | None = None   # (ok, message) once compared


class AsyncMirrorCheck:
    """Double-buffered async snapshots of one rank's device fields.

    Args:
        state: the rank's DeviceState (device tensors ``[max_num_reqs]`` int64, ``mirror``,
            ``owner``, ``live_slots()``, ``block_size``).
        sink: where ``mirror.check`` events go when it is enabled (tracing); rank: their rank.
    """

    def __init__(self, state, sink: EventSink = NULL_SINK, rank: int | None = None) -> None:
        self.state, self.sink, self.rank = state, sink, rank
        pin = state.device.type == "cuda"
        n, cols = state.block_table_np.shape
        size = state_check.flat_size(n, cols)                             # the most columns
        self.host_flat = [torch.empty(size, dtype=torch.int32, pin_memory=pin)
                          for _ in range(2)]                              # 2 x [flat_size]
        self.expected_flat = [np.empty(size, dtype=np.int32) for _ in range(2)]
        self._nct = MIRROR_FIELDS.index("num_computed_tokens")
        self._nb = MIRROR_FIELDS.index("num_blocks")
        self.pending: list[_Pending] = []
        self._error: MirrorDivergence | None = None   # found while recording, raised next
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
            if self.sink.enabled:   # nothing to compare, recorded as the synchronous check does
                self.sink.emit("mirror.check", step=step, rank=self.rank, slots=[],
                               num_computed_tokens=[], ok=True, message=None)
            return
        k = step % 2
        cols = state_check.used_cols(self.state, live)
        size = state_check.flat_size(m_slots(self.state), cols)
        self.host_flat[k][:size].copy_(state_check.device_flat(self.state, cols), non_blocking=True)
        event = None
        if self.state.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        state_check.host_flat(self.state, cols, self.expected_flat[k][:size])
        p = _Pending(step, k, live, list(self.state.owner), event, cols)
        self.pending.append(p)
        if self.sink.enabled:
            values = self.state.mirror.num_computed_tokens_np[live].tolist()
            self.sink.emit_when(lambda: p.verdict is not None or p.event is None
                                or p.event.query(), "mirror.check", step, self.rank,
                                lambda: self._check_fields(p, values))
        if event is None:
            self.poll(block=True)

    def _check_fields(self, p: _Pending, values: list[int]) -> dict:
        """The ``mirror.check`` event's fields of ``p``, compared now if its copy landed but no poll
        ran yet (a divergence found here is recorded and raised by the snapshot or poll that
        follows, as the check's own order has it: the comparisons run in snapshot order)."""
        if p.verdict is None:
            try:
                self.poll(until=p)
            except MirrorDivergence as exc:   # raised by the next snapshot / poll, not here
                self._error = exc
        ok, message = p.verdict if p.verdict is not None else (True, None)
        return {"slots": p.live.tolist(), "num_computed_tokens": values, "ok": ok,
                "message": message}

    def poll(self, block: bool = False, until: _Pending | None = None) -> None:
        """Compare every pending snapshot whose copy has completed (all of them with ``block``;
        with ``until``, only the snapshots up to that one, whose copy has landed).

        Raises:
            MirrorDivergence: the first divergence found (also one found earlier while the
                trace recorded a check, :meth:`_check_fields`).
        """
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        while self.pending:
            p = self.pending[0]
            if p.event is not None:
                if not block and until is None and not p.event.query():
                    return
                p.event.synchronize()
            self.pending.pop(0)
            self._compare(p)
            if p is until:
                return

    def _compare(self, p: _Pending) -> None:
        self.checked_steps += 1
        n = m_slots(self.state)
        size = state_check.flat_size(n, p.cols)
        dev_flat, exp_flat = self.host_flat[p.buf][:size].numpy(), self.expected_flat[p.buf][:size]
        exp = state_check.unpack(exp_flat, n, p.cols)[0]                  # [F, max_num_reqs]
        bs, slack = self.state.block_size, 2 * (self.state.width - 1)  # spec drafts' blocks
        held, computed = exp[self._nb, p.live], exp[self._nct, p.live]   # [num_live] each
        try:
            if not state_check.same(dev_flat, exp_flat):   # names the first (field, slot)
                state_check.compare(dev_flat, exp_flat, n, p.cols, p.live, p.step,
                                    self.state.mirror.rank, p.owners)
            if not ((held >= -(-computed // bs)).all()
                    and (held <= -(-(computed + slack) // bs)).all()):
                self._raise_blocks(p, exp)
        except MirrorDivergence as exc:
            p.verdict = (False, str(exc))
            raise
        p.verdict = (True, None)

    def _raise_blocks(self, p: _Pending, exp: np.ndarray) -> None:
        """The first slot of ``p`` whose block count breaks invariant 9, as
        ``CpuMirror.validate_blocks`` names it (``exp``: the counters ``[F, max_num_reqs]``)."""
        expected = CpuMirror(exp.shape[1], rank=self.state.mirror.rank)
        for i, f in enumerate(MIRROR_FIELDS):
            np.copyto(expected.array(f), exp[i])
        expected.validate_blocks(self.state.block_size, p.live, p.step, owners=p.owners,
                                 spec_slack=2 * (self.state.width - 1))
