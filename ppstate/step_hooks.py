"""The one seam through which a known-bad variant (:mod:`ppstate.mutants`) changes the rank step
order of :class:`~ppstate.rank_step.RankStep`.

The step order asks :func:`current` for its hooks once per step and calls them at four decision
points; the correct order's hooks (:data:`CORRECT`) change nothing, so no mutant appears as a
branch of the order itself. :class:`MutantHooks` holds the variants of the model checker's
``rank_local_skip`` and ``blocking_all_chunk_broadcast`` (docs/checker.md) and the simulator's
``keep_rejected_draft`` (docs/spec_decode.md).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput
from ppstate.payload import SampledPayload
from ppstate.pp_handler import PPHandler


class StepOrder(Protocol):
    """What a hook may call of the step order (:class:`~ppstate.rank_step.RankStep`; a Protocol,
    so this module does not import it)."""
    handler: PPHandler | None

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> Any:
        """Post the step's receive on the backend and record it; its handle."""

    def apply_received(self, out: SchedulerOutput, mask: np.ndarray, handle: Any) -> None:
        """Apply the waited receive ``handle`` of step ``out`` at once."""


class StepHooks:
    """The correct step order's decisions at its three seams (each returns its input)."""

    def step_mask(self, out: SchedulerOutput, mask: np.ndarray | None) -> np.ndarray | None:
        """Every rank: the step's need-sampled mask (``[num_rows]`` bool, or None: no row needs
        a sample), as :func:`~ppstate.pp_handler.need_sampled_mask` decided it."""
        return mask

    def publish_mask(self, backend: Any, out: SchedulerOutput,
                     mask: np.ndarray | None) -> np.ndarray | None:
        """Last rank: the mask it publishes the broadcast with (None: it skips)."""
        return mask

    def receive_now(self, order: StepOrder, out: SchedulerOutput, mask: np.ndarray) -> bool:
        """Non-last rank: True when the hook itself posted, waited for and applied the step's
        receive (the deferred path is then not taken)."""
        return False

    def consumed(self, rank: int, payload: SampledPayload) -> SampledPayload:
        """Non-last rank ``rank``: the consumed payload it applies (deferred consume)."""
        return payload


class MutantHooks(StepHooks):
    """The hooks while a mutant is switched on (:func:`ppstate.mutants.enabled`)."""

    def step_mask(self, out: SchedulerOutput, mask: np.ndarray | None) -> np.ndarray | None:
        if mask is None and self._blocking(out):   # every step posts the broadcast
            return np.zeros(out.num_rows, dtype=bool)
        return mask

    def publish_mask(self, backend: Any, out: SchedulerOutput,
                     mask: np.ndarray | None) -> np.ndarray | None:
        if mutants.active("rank_local_skip") and mask is not None:
            return mutants.rank_local_mask(backend, out, mask)
        return mask

    def receive_now(self, order: StepOrder, out: SchedulerOutput, mask: np.ndarray) -> bool:
        """``blocking_all_chunk_broadcast``: the receive is posted and waited for at once, even
        when no row needs it, and applied in this step (as before vLLM #38726)."""
        if not self._blocking(out):
            return False
        handle = order.post_receive(out, mask)
        order.handler.enqueue(out.step, out, None)
        if callable(getattr(handle, "wait", None)):
            handle.wait()
        order.apply_received(out, mask, handle)
        return True

    def consumed(self, rank: int, payload: SampledPayload) -> SampledPayload:
        """``keep_rejected_draft``: rank 0 applies the payload without its rejections (a numpy
        copy with ``num_rejected = 0``): it keeps the positions of rejected drafts as computed,
        on its device counters and its mirror alike."""
        if rank != 0 or not mutants.active("keep_rejected_draft"):
            return payload
        kept = SampledPayload(np.array(payload.buf, copy=True))
        kept.num_rejected[:] = 0
        return kept

    @staticmethod
    def _blocking(out: SchedulerOutput) -> bool:
        return mutants.active("blocking_all_chunk_broadcast") and out.num_rows > 0


#: the correct order's hooks
CORRECT = StepHooks()
_MUTANT = MutantHooks()


def current() -> StepHooks:
    """The hooks of the step about to run: :data:`CORRECT` unless a mutant is switched on."""
    return _MUTANT if mutants.any_active() else CORRECT
