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

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ppstate import step_hooks
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
        """Start of step ``out.step`` (reset per-step timing)."""

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
        """Last rank: broadcast ``payload`` to the other ranks when ``mask`` is not None (a
        single-rank pipeline has no one to send to); the step order records the decision."""

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> Any:
        """Non-last ranks: post the receive of step ``out.step``'s payload; returns the handle
        the PPHandler queues (its ``wait()``, if any, is called on the deferred consume)."""

    def skip_receive(self, out: SchedulerOutput) -> None:
        """Non-last ranks: no row of the step needs a sample, nothing is received (the step
        order records the skip)."""

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        """The payload of a consumed (already waited) receive, ``entry.handle`` as posted."""

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        """Last rank: the step's result for the scheduler, from ``payload``."""

    def sampled_ids(self, out: SchedulerOutput, payload: SampledPayload,
                    result: Any) -> tuple[Callable[[], bool], Callable[[], dict]]:
        """Last rank, tracing on, a step with rows: ``(ready, ids)`` of the ``sampled`` event:
        ``ids()`` gives ``token_ids`` (``[num_rows][width]``) and ``num_sampled``
        (``[num_rows]``) once ``ready()`` (e.g. the device-to-host copy of ``result`` landed)."""

    def end_step(self, out: SchedulerOutput) -> None:
        """End of the step: validate (or snapshot for a later comparison) the CPU mirrors."""


def sampled_idx_mapping(out: SchedulerOutput, mask: np.ndarray | None) -> np.ndarray:
    """``[num_rows]`` int64: the slot of each row that needs a sample, -1 elsewhere."""
    if mask is None:
        return np.full(out.num_rows, -1, dtype=np.int64)
    return np.where(mask, out.slots, -1).astype(np.int64)


class Phases(Protocol):
    """Where a rank reports the phase of its step (the runtime's
    :class:`~runtime.worker.progress.Progress`, read by its heartbeat for stall detection)."""

    def enter(self, phase: str) -> None:
        """The rank starts ``phase`` (``recv``, ``forward``, ``send``, ``post``, ``sample``)."""


class _NoPhases:
    """Phases reported nowhere (the simulator, the model checker, replay)."""

    def enter(self, phase: str) -> None:
        return None

    def __reduce__(self) -> str:
        return "NO_PHASES"   # pickled by reference: one object, so equal checker states pickle alike


NO_PHASES = _NoPhases()


class RankStep:
    """Runs steps of rank ``rank`` of ``pp_size`` on ``backend`` in the one order, and records
    the rank's decisions: it emits ``rank.step``, ``broadcast.posted`` / ``broadcast.skipped``
    and ``sampled`` (its PPHandler ``pp.enqueue`` / ``pp.consume`` / ``pp.free``) and enters the
    step's phases, so every backend records the same decisions in the same order
    (docs/trace_format.md). A backend only applies effects; ``mirror.check`` (the outcome of its
    validation) and phase timings are its own.

    Args:
        backend: the executor (:class:`RankBackend`).
        rank: PP rank; pp_size: stages.
        depth: PPHandler depth: ``pp_size`` (overlapped) or 1 (sync).
        max_num_reqs: slots.
        sink: event sink of the rank's decisions and its PPHandler.
        phases: where the phases are reported (:class:`Phases`; default: nowhere).

    Attributes:
        handler: the PPHandler of a non-last rank of a multi-rank pipeline, else None.
        next_step: the number after the last step run (0 before the first); numbers below the
            next issued step were skipped by the scheduler.

    Raises:
        SlotError: ``depth < 1`` or ``max_num_reqs < 1`` (from PPHandler).
    """

    def __init__(self, backend: RankBackend, rank: int, pp_size: int, depth: int,
                 max_num_reqs: int, sink: EventSink = NULL_SINK,
                 phases: Phases = NO_PHASES) -> None:
        self.backend, self.rank, self.pp_size = backend, rank, pp_size
        self.sink, self.phases = sink, phases
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
        b, hooks = self.backend, step_hooks.current()
        if out.step < self.next_step:
            raise PPStateError(f"rank {self.rank}: step {out.step} after step {self.next_step - 1}")
        b.begin_step(out)
        if self.sink.enabled:
            self.sink.emit("rank.step", step=out.step, rank=self.rank, num_rows=out.num_rows)
        self._skip_to(out.step)
        self._consume()
        if self.handler is not None:
            for f in out.freed:
                self.handler.on_slot_freed(f.slot, out.step)
        b.free_and_admit(out)
        mask = hooks.step_mask(out, need_sampled_mask(out))
        logits = self._forward(out) if out.num_rows else None
        result = None
        if self.is_last:
            result = self._sample_and_publish(out, mask, logits, hooks)
        elif mask is None:
            self.handler.enqueue(out.step, out, None)
            b.skip_receive(out)
            self._broadcast_event(out, None)
        elif not hooks.receive_now(self, out, mask):
            self.handler.enqueue(out.step, out, mask, self.post_receive(out, mask))
        self.phases.enter("post")
        b.end_step(out)
        self.next_step = out.step + 1
        return result

    def _sample_and_publish(self, out: SchedulerOutput, mask: np.ndarray | None, logits: Any,
                            hooks: step_hooks.StepHooks) -> StepResult:
        """Last rank: sample, apply, publish (or skip) the broadcast, the step's result."""
        b = self.backend
        self.phases.enter("sample")
        payload = b.sample(out, mask, logits)
        if out.num_rows:
            b.apply_sampled(out.step, sampled_idx_mapping(out, mask), payload)
        mask = hooks.publish_mask(b, out, mask)
        b.publish(out, mask, payload)
        if self.pp_size > 1:
            self._broadcast_event(out, mask)
        result = b.result(out, payload)
        if out.num_rows and self.sink.enabled:
            ready, ids = b.sampled_ids(out, payload, result)
            req_ids = list(out.req_ids)
            self.sink.emit_when(ready, "sampled", out.step, self.rank,
                                lambda: {"req_ids": req_ids, **ids()})
        return result

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> Any:
        """Non-last rank: post the step's receive on the backend and record it; its handle."""
        handle = self.backend.post_receive(out, mask)
        self._broadcast_event(out, mask)
        return handle

    def apply_received(self, out: SchedulerOutput, mask: np.ndarray, handle: Any) -> None:
        """Apply the (waited) receive ``handle`` of step ``out`` at once, not deferred (the
        ``blocking_all_chunk_broadcast`` mutant's path, :mod:`ppstate.step_hooks`)."""
        entry = ConsumedEntry(out.step, sampled_idx_mapping(out, mask), handle, mask)
        self.backend.apply_sampled(out.step, entry.idx_mapping, self.backend.received(entry))

    def _broadcast_event(self, out: SchedulerOutput, mask: np.ndarray | None) -> None:
        if not self.sink.enabled:
            return
        if mask is None:
            self.sink.emit("broadcast.skipped", step=out.step, rank=self.rank)
        else:
            self.sink.emit("broadcast.posted", step=out.step, rank=self.rank, rows=int(mask.sum()))

    def _skip_to(self, step: int) -> None:
        """The PPHandler's turns of the numbers skipped before ``step`` (module docstring)."""
        if self.handler is not None:
            for skipped in range(self.next_step, step):
                self._consume()
                self.handler.push_empty(skipped)

    def _consume(self) -> None:
        if self.handler is None:
            return
        entry = self.handler.consume()      # waits on the posted receive, if any
        if entry is not None:
            payload = step_hooks.current().consumed(self.rank, self.backend.received(entry))
            self.backend.apply_sampled(entry.step, entry.idx_mapping, payload)

    def _forward(self, out: SchedulerOutput) -> Any:
        b, phases = self.backend, self.phases
        inputs = b.prepare_inputs(out)
        received = None
        if self.rank > 0:
            phases.enter("recv")
            received = b.receive(out)
        phases.enter("forward")
        hidden = b.forward(out, inputs, received)
        if not self.is_last:
            phases.enter("send")
            b.send(out, hidden)
        phases.enter("post")
        b.apply_scheduled(out)
        return hidden
