"""When and how one rank validates its mirrors against its device state (invariant 4,
docs/mirror_audit.md): the mirror-check part of :class:`~runtime.worker.runner.StageRunner`.

:class:`MirrorSchedule` decides, for each step that validates (``validate_every``), where in the
step's order the check runs. On the CPU it runs at once, at the end of the step. On CUDA it is
:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`'s snapshot, compared on the device and
read back at the latest while the next step finishes.
"""

from __future__ import annotations

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.events import EventSink
from runtime.host_copy import PendingCopy
from runtime.worker.device_state import DeviceState
from runtime.worker.grammar_hooks import GrammarHooks
from runtime.worker.mirror_check import AsyncMirrorCheck


class MirrorSchedule:
    """Owns one rank's mirror checks and decides when they run relative to the step's result.

    It owns the CUDA check (:attr:`check`, None on the CPU), the step whose snapshot waits to
    run after the result has left (:meth:`run_deferred_check`), the last step whose snapshot
    rode on the result copy, and whether the token mirror takes the last rank's sampled ids
    from that copy. :class:`~runtime.worker.runner.StageRunner` calls it from these points of
    :class:`~ppstate.rank_step.RankStep`'s order:

    * ``free_and_admit``, before the forward: :meth:`check_digests` (check 1). On CUDA it
      hands the scheduler's block-id digests to the step's snapshot. On the CPU it compares
      them with the host table at once.
    * ``apply_sampled``: :meth:`defer_tokens`. The last rank's own ids reach the token mirror
      through its result copy, so it makes no copy of its own.
    * last rank, ``result``: :meth:`before_result` before the copy of the sampled ids to
      pinned memory, :meth:`after_result` after it.
    * ``end_step``, after the result on the last rank: :meth:`end_step`.
    * after the step's result has been sent (the worker's loop, ``StageRunner.step``), and
      at the latest in the next ``begin_step``, before that step changes any state:
      :meth:`run_deferred_check`.

    Where the check of a validated step runs:

    * CPU: synchronously in :meth:`end_step`, traced or not. When tracing it is recorded as
      ``mirror.check``.
    * CUDA, untraced: :meth:`end_step` only notes the step. Its snapshot is enqueued by
      :meth:`run_deferred_check`, after the step's result has left the worker, so none of the
      check's host work lies between a step's launch and the engine receiving its result.
    * CUDA, traced, last rank with rows: the snapshot keeps its place in the trace. It is
      enqueued in :meth:`before_result`, just before the result copy, whose event then also
      covers the check's copies (:meth:`after_result` shares it). :meth:`end_step` then does
      nothing more for the check.
    * CUDA, traced, any other rank (or a last-rank step without rows): the snapshot is taken
      in :meth:`end_step` and compared once its copies land.

    On CUDA a snapshot first finishes the comparison of the one before it (waiting for its
    flag if still in flight), and :meth:`end_step` of a step that does not validate polls the
    landed ones. A divergence is therefore raised within one step, by whichever of these runs
    next. A snapshot left pending by a caller that never ran :meth:`run_deferred_check` runs
    in the next ``begin_step``, so it sees the step's state and its error is raised before the
    next step changes anything. Beyond what the checks themselves do, no call here makes a host
    sync or allocates.

    Args:
        state: the rank's DeviceState (device tensors, mirrors, the token mirror).
        every: validate the mirrors every N steps (0 = never).
        sink: where ``mirror.check`` events go; ``sink.enabled`` picks the traced order.
        rank: this rank (events, errors).
        kernel: ``--mirror-check-kernel`` (``graph`` / ``fused``) of the CUDA check.
        grammar: the last rank's structured-output hooks (their matchers are checked on each
            validated step), or None.
    """

    def __init__(self, state: DeviceState, every: int, sink: EventSink, rank: int,
                 kernel: str = "graph", grammar: GrammarHooks | None = None) -> None:
        self.state, self.every, self.sink, self.rank = state, every, sink, rank
        self.grammar = grammar
        self.check = (AsyncMirrorCheck(state, sink, rank, kernel)
                      if state.device.type == "cuda" else None)
        if every:   # the token ids a step reads, against an exact host copy
            state.track_tokens()
        self._snapped = -1       # the last step whose mirror snapshot result() took (last rank)
        self._deferred = -1      # a step whose CUDA mirror snapshot waits for run_deferred_check
        self._tokens_later = False   # apply_sampled left the token mirror's ids to result()

    def validating(self, step: int) -> bool:
        """Whether step ``step`` validates the mirrors (``every``)."""
        return bool(self.every) and step % self.every == 0

    def check_digests(self, out: SchedulerOutput) -> None:
        """Check 1 of a validated step, after its block-table updates and before its forward:
        on CUDA the scheduler's digests go with the step's snapshot (compared on the device),
        on the CPU the rows the forward reads are compared now.

        Raises:
            MirrorDivergence: (CPU) a row's block ids differ from the scheduler's.
        """
        if self.validating(out.step):
            if self.check is not None:   # checked on the device with the step's snapshot
                self.check.expect_digests(out)
            else:   # the ids the forward reads against the scheduler's, before it
                self.state.check_block_digests(out)

    def defer_tokens(self, own: bool) -> bool:
        """Whether the sampled ids being applied reach the token mirror later, from the result
        copy (:meth:`after_result`): only the last rank's ``own`` ids, on CUDA, when tracked."""
        later = own and self.check is not None and self.state.tokens is not None
        self._tokens_later = later
        return later

    def before_result(self, step: int) -> bool:
        """Last rank, before its result copy: when tracing, enqueue the step's snapshot here
        (``later=True``: its event is the copy's). Returns whether it did."""
        snap = self.check is not None and self.sink.enabled and self.validating(step)
        if snap:
            self.check.snapshot(step, later=True)
            self._snapped = step
        return snap

    def after_result(self, copy: PendingCopy, snap: bool, width: int) -> None:
        """Last rank, after its result copy was enqueued: the token mirror takes the ids
        (``copy.host[:, :width]``) recorded in :meth:`defer_tokens`; a ``snap`` of
        :meth:`before_result` gets the copy whose event stands for its own."""
        if self._tokens_later:   # the ids the token mirror recorded in apply_sampled
            self.state.tokens.attach(copy.host[:, :width])
            self._tokens_later = False
        if snap:
            self.check.share(copy)

    def end_step(self, step: int) -> None:
        """The check of step ``step`` at the end of the step (see the class docstring).

        Raises:
            MirrorDivergence: the mirrors (CPU: of this step; CUDA: of an earlier snapshot)
                differ from device state, or a grammar matcher from its slot's output.
        """
        if self.validating(step):
            if self.grammar is not None:
                self.grammar.validate(self.state, step, self.rank)
            if self._snapped == step:
                pass   # the last rank's snapshot went with its result copy (result)
            elif self.check is not None and not self.sink.enabled:
                self._deferred = step   # after the step's result has left
            elif self.check is not None:
                self.check.snapshot(step)   # compared when its copy lands
            else:
                self._validate(step)
        elif self.check is not None:
            self.check.poll()

    def run_deferred_check(self) -> None:
        """Enqueue the CUDA snapshot that :meth:`end_step` left for after the result (the
        device work after the step's kernels and result copy, with its own event), if one
        waits. Nothing waits without CUDA, with tracing, or on a step that does not validate.

        Raises:
            MirrorDivergence: from the comparison of an earlier snapshot (as
                :meth:`AsyncMirrorCheck.snapshot`).
        """
        step, self._deferred = self._deferred, -1
        if step >= 0:
            self.check.snapshot(step)   # compared when its copy lands

    def _validate(self, step: int) -> None:
        """Mirror validation (invariant 4) on the CPU, recorded as ``mirror.check`` when
        tracing."""
        if not self.sink.enabled:
            self.state.validate(step)
            return
        live: np.ndarray = self.state.live_slots()   # [num_live] slots
        values = self.state.mirror.num_computed_tokens_np[live].tolist()
        try:
            self.state.validate(step)
        except Exception as exc:
            self.sink.emit("mirror.check", step=step, rank=self.rank, slots=live.tolist(),
                           num_computed_tokens=values, ok=False, message=str(exc))
            raise
        self.sink.emit("mirror.check", step=step, rank=self.rank, slots=live.tolist(),
                       num_computed_tokens=values, ok=True, message=None)
