"""The order of one PP rank's step, written once, over a narrow backend protocol.

:class:`RankStep` drives a :class:`RankBackend`. The runtime's ``StageRunner``
(``runtime/worker/runner.py``: torch, torch.distributed) and the simulator's ``SimRank``
(``ppstate/sim/rank.py``: integer ticks, a cost model, invariant checks) are two backends; a
model checker is a third. What the simulator checks is therefore the order the runtime runs.

The order of step ``s`` on rank ``r`` of ``pp_size`` (docs/design.md, "The step of a rank"):

1. ``begin_step``; then, for every number the scheduler skipped since the rank's previous step
   (a step that would have carried nothing is not issued), the PPHandler turns over as in an
   empty step: consume the entry of ``skipped - depth`` (applied like step 2's), enqueue an
   empty entry for ``skipped``. The numbers are the replicated step numbers, so every rank
   rotates alike.
2. Deferred consume (non-last ranks): pop the PPHandler entry of step ``s - depth``; the handler
   waits on its posted receive; usable rows are applied to device state (``apply_sampled``:
   write ``token_ids``, advance by ``num_sampled``, subtract ``num_rejected``).
3. Free / admit: every freed slot bumps its PPHandler generation, then the backend frees the
   slots, initialises the admitted ones and applies the block-table deltas.
4. Non-empty steps only: ``prepare_inputs`` -> ``receive`` (ranks > 0) -> ``forward`` ->
   ``send`` (non-last ranks) -> ``apply_scheduled`` (immediate post-update: +query length).
5. Last rank: ``sample`` -> ``apply_sampled`` on its own state -> ``publish`` (broadcast, or skip
   when no row needs a sample) -> ``result``. Other ranks: ``post_receive`` then enqueue the
   pending PPHandler entry, or enqueue an empty entry then ``skip_receive``.
6. ``end_step`` (validate or snapshot the CPU mirrors).

``depth`` is ``pp_size`` in overlapped mode and 1 in sync mode: both modes run this same order
(docs/design.md says why sync uses a depth-1 PPHandler rather than a blocking broadcast).
Every post / skip decision is :func:`~ppstate.pp_handler.need_sampled_mask` of the replicated
SchedulerOutput (invariant 1); stale rows are dropped by the PPHandler (invariant 2).

``num_rejected`` (speculative decoding) is applied in one place of the order: ``apply_sampled``,
immediately after sampling on the last rank and on the deferred consume on the others.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput, StepResult
from ppstate.errors import PPStateError
from ppstate.events import NULL_SINK, EventSink
from ppstate.payload import SampledPayload
from ppstate.pp_handler import ConsumedEntry, PPHandler, need_sampled_mask


class RankBackend(Protocol):
    """What :class:`RankStep` needs from one rank's executor. Called only by RankStep, in the
    order of the module docstring; "device state" is whatever the backend keeps per slot
    (tensors, arrays) plus its :class:`~ppstate.mirror.CpuMirror`."""

    def begin_step(self, out: SchedulerOutput) -> None:
        """Start of step ``out.step`` (reset per-step timing, trace the step)."""

    def free_and_admit(self, out: SchedulerOutput) -> None:
        """Free ``out.freed`` slots, initialise ``out.new_requests`` slots (device + mirror),
        apply the block-table deltas. PPHandler generations are already bumped."""

    def prepare_inputs(self, out: SchedulerOutput) -> Any:
        """Step inputs built from device state (metadata; rank 0: input token ids). Non-empty
        steps only."""

    def receive(self, out: SchedulerOutput) -> Any:
        """Ranks > 0: the hidden states of step ``out.step`` from rank - 1 (blocking)."""

    def forward(self, out: SchedulerOutput, inputs: Any, received: Any) -> Any:
        """Run the rank's layers; returns hidden states (non-last) or logits (last rank).
        ``received`` is None on rank 0."""

    def send(self, out: SchedulerOutput, hidden: Any) -> None:
        """Non-last ranks: hand ``hidden`` of step ``out.step`` to rank + 1 (non-blocking)."""

    def apply_scheduled(self, out: SchedulerOutput) -> None:
        """Immediate post-update after the forward: ``num_computed_tokens[slot] +=
        num_scheduled_tokens`` of every row, on device state and mirror."""

    def sample(self, out: SchedulerOutput, mask: np.ndarray | None, logits: Any) -> SampledPayload:
        """Last rank: sample the rows of ``mask`` (``[num_rows]`` bool, or None: no row).

        Returns a payload of ``out.num_rows`` rows (``num_sampled = 0`` on rows not sampled;
        zero rows for an empty step, where ``logits`` is None)."""

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        """Sampled post-update of step ``step``'s payload: for each row ``i`` with
        ``idx_mapping[i] >= 0`` (``[num_rows]`` int64 slot, -1 = skip), write ``token_ids[i,
        :num_sampled[i]]``, advance the slot's length by ``num_sampled[i]`` and subtract
        ``num_rejected[i]`` from its ``num_computed_tokens`` (device + mirror)."""

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                payload: SampledPayload) -> None:
        """Last rank: broadcast ``payload`` to the other ranks when ``mask`` is not None, else
        record the skip (a single-rank pipeline has no one to send to)."""

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> Any:
        """Non-last ranks: post the receive of step ``out.step``'s payload; returns the handle
        the PPHandler queues (its ``wait()``, if any, is called on the deferred consume)."""

    def skip_receive(self, out: SchedulerOutput) -> None:
        """Non-last ranks: no row of the step needs a sample, nothing is received."""

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        """The payload of a consumed (already waited) receive, ``entry.handle`` as posted."""

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        """Last rank: the step's result for the scheduler, from ``payload``."""

    def end_step(self, out: SchedulerOutput) -> None:
        """End of the step: validate (or snapshot for a later comparison) the CPU mirrors."""


def sampled_idx_mapping(out: SchedulerOutput, mask: np.ndarray | None) -> np.ndarray:
    """``[num_rows]`` int64: the slot of each row that needs a sample, -1 elsewhere."""
    if mask is None:
        return np.full(out.num_rows, -1, dtype=np.int64)
    return np.where(mask, out.slots, -1).astype(np.int64)


class RankStep:
    """Runs steps of rank ``rank`` of ``pp_size`` on ``backend`` in the one order.

    Args:
        backend: the executor (:class:`RankBackend`).
        rank: PP rank; pp_size: stages.
        depth: PPHandler depth: ``pp_size`` (overlapped) or 1 (sync).
        max_num_reqs: slots.
        sink: event sink of the PPHandler (``pp.enqueue`` / ``pp.consume`` / ``pp.free``).

    Attributes:
        handler: the PPHandler of a non-last rank of a multi-rank pipeline, else None.
        next_step: the number after the last step run (0 before the first); numbers below the
            next issued step were skipped by the scheduler.

    Raises:
        SlotError: ``depth < 1`` or ``max_num_reqs < 1`` (from PPHandler).
    """

    def __init__(self, backend: RankBackend, rank: int, pp_size: int, depth: int,
                 max_num_reqs: int, sink: EventSink = NULL_SINK) -> None:
        self.backend, self.rank, self.pp_size = backend, rank, pp_size
        self.is_last = rank == pp_size - 1
        self.handler: PPHandler | None = None
        if not self.is_last:
            self.handler = PPHandler(depth, max_num_reqs, sink=sink, rank=rank)
        self.next_step = 0

    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Run step ``out``; returns its StepResult on the last rank, None elsewhere.

        Raises:
            PPStateError: ``out.step`` is below :attr:`next_step` (steps out of order).
            Whatever the backend raises (a peer timeout, a mirror divergence).
        """
        b = self.backend
        if out.step < self.next_step:
            raise PPStateError(f"rank {self.rank}: step {out.step} after step {self.next_step - 1}")
        b.begin_step(out)
        self._skip_to(out.step)
        self._consume()
        if self.handler is not None:
            for f in out.freed:
                self.handler.on_slot_freed(f.slot, out.step)
        b.free_and_admit(out)
        mask = need_sampled_mask(out)
        logits = self._forward(out) if out.num_rows else None
        result = None
        blocking = mutants.active("blocking_all_chunk_broadcast") and out.num_rows > 0  # mutant
        if blocking and mask is None:
            mask = np.zeros(out.num_rows, dtype=bool)
        if self.is_last:
            payload = b.sample(out, mask, logits)
            if out.num_rows:
                b.apply_sampled(out.step, sampled_idx_mapping(out, mask), payload)
            if mutants.active("rank_local_skip") and mask is not None:   # mutant
                mask = mutants.rank_local_mask(b, out, mask)
            b.publish(out, mask, payload)
            result = b.result(out, payload)
        elif mask is None:
            self.handler.enqueue(out.step, out, None)
            b.skip_receive(out)
        elif blocking:
            self._receive_now(out, mask)
        else:
            self.handler.enqueue(out.step, out, mask, b.post_receive(out, mask))
        b.end_step(out)
        self.next_step = out.step + 1
        return result

    def _skip_to(self, step: int) -> None:
        """The PPHandler's turns of the numbers skipped before ``step`` (module docstring)."""
        if self.handler is not None:
            for skipped in range(self.next_step, step):
                self._consume()
                self.handler.push_empty(skipped)

    def _receive_now(self, out: SchedulerOutput, mask: np.ndarray) -> None:
        """Mutant ``blocking_all_chunk_broadcast`` (``ppstate.mutants``; the model checker's):
        the receive is posted and waited for at once, even when no row needs it, and applied
        in this step (as before vLLM #38726)."""
        handle = self.backend.post_receive(out, mask)
        self.handler.enqueue(out.step, out, None)
        if callable(getattr(handle, "wait", None)):
            handle.wait()
        entry = ConsumedEntry(out.step, sampled_idx_mapping(out, mask), handle, mask)
        self.backend.apply_sampled(out.step, entry.idx_mapping, self.backend.received(entry))

    def _consume(self) -> None:
        if self.handler is None:
            return
        entry = self.handler.consume()      # waits on the posted receive, if any
        if entry is not None:
            self.backend.apply_sampled(entry.step, entry.idx_mapping, self.backend.received(entry))

    def _forward(self, out: SchedulerOutput) -> Any:
        b = self.backend
        inputs = b.prepare_inputs(out)
        received = b.receive(out) if self.rank > 0 else None
        hidden = b.forward(out, inputs, received)
        if not self.is_last:
            b.send(out, hidden)
        b.apply_scheduled(out)
        return hidden
