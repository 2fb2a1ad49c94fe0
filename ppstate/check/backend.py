"""The model checker's backend of the shared step order: the
:class:`~ppstate.rank_step.RankBackend` methods of :class:`~ppstate.check.rank.CheckRank`
(``begin_step``, ``free_and_admit``, ``prepare_inputs``, ``receive``, ``forward``, ``send``,
``apply_scheduled``, ``sample``, ``apply_sampled``, ``publish``, ``post_receive``, ``skip_receive``,
``received``, ``result``, ``end_step``).

"Hidden states" are rank 0's input token per row (``[num_rows]``), so the last rank's sample is
conditioned on what rank 0 read. The broadcast payload is a
:class:`~ppstate.payload.SampledPayload` of width 1 (``[num_rows, 3]`` int64). Events are emitted
by the step order (:class:`~ppstate.rank_step.RankStep`, ``docs/trace_format.md``) and feed the
monitor through the rank's sink; the backend adds only ``mirror.check``, the outcome of its
validation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.payload import SampledPayload

if TYPE_CHECKING:
    from ppstate.check.comm import Op
    from ppstate.pp_handler import ConsumedEntry


def _ready() -> bool:
    return True


class OpHandle:
    """Completion handle of a posted deferred receive (what the PPHandler keeps per entry)."""

    def __init__(self, rank: "BackendMethods", op: "Op") -> None:
        self.rank, self.op = rank, op

    def wait(self) -> None:
        self.rank.wait(self.op)


class BackendMethods:
    """Protocol methods of :class:`~ppstate.check.rank.CheckRank` (attributes documented there)."""

    def begin_step(self, out: SchedulerOutput) -> None:
        return None

    def free_and_admit(self, out: SchedulerOutput) -> None:
        self.apply_freed_new(out)

    def prepare_inputs(self, out: SchedulerOutput) -> np.ndarray | None:
        self.world.monitor.check_inputs(self, out)
        return self.slot_tokens.input_tokens(out) if self.is_first else None

    def receive(self, out: SchedulerOutput) -> np.ndarray:
        return self.recv_prev(out.step)

    def forward(self, out: SchedulerOutput, inputs: Any, received: Any) -> np.ndarray:
        return inputs if received is None else received

    def send(self, out: SchedulerOutput, hidden: np.ndarray) -> None:
        self.send_next(out.step, hidden)

    def sample(self, out: SchedulerOutput, mask: np.ndarray | None, logits: Any) -> SampledPayload:
        buf = np.zeros((out.num_rows, 3), dtype=np.int64)
        if out.num_rows:
            ids, num_sampled, rejected = self.sample_rows(out, mask, logits, self.world.spec_tokens)
            buf[:, 0], buf[:, 1], buf[:, 2] = ids[:, 0], num_sampled, rejected
            self.world.monitor.record_sampled(out, ids[:, 0])
        return SampledPayload(buf)

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        src = self.world.outputs[step] if not self.is_last else None
        self.apply_sampled_rows(idx_mapping, payload.token_ids, payload.num_sampled,
                                payload.num_rejected, src)

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None, payload: SampledPayload) -> None:
        if self.pp_size > 1 and mask is not None:
            self.post_broadcast(out.step, (out.step, payload), root=True)

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> OpHandle:
        return OpHandle(self, self.post_broadcast(out.step, None, root=False))

    def skip_receive(self, out: SchedulerOutput) -> None:
        return None

    def received(self, entry: "ConsumedEntry") -> SampledPayload:
        got = entry.handle.op.payload   # (step, payload); another step's after a mismatch
        if got is None:                  # matched with no root (a mismatch): nothing arrived
            return SampledPayload(np.zeros((len(entry.idx_mapping), 3), dtype=np.int64))
        payload = got[1]
        if payload.buf.shape[0] != len(entry.idx_mapping):   # mismatch: sizes differ
            return SampledPayload(np.zeros((len(entry.idx_mapping), 3), dtype=np.int64))
        return payload

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        return StepResult(out.step, payload.token_ids.copy(), payload.num_sampled.astype(np.int32),
                          payload.num_rejected.astype(np.int32))

    def sampled_ids(self, out: SchedulerOutput, payload: SampledPayload, result: StepResult):
        ids = {"token_ids": payload.token_ids.tolist(), "num_sampled": payload.num_sampled.tolist()}
        return _ready, lambda: ids

    def end_step(self, out: SchedulerOutput) -> None:
        self.validate(out.step, check_blocks=self.world.spec_tokens == 0)
