"""One simulated PP rank: the simulator's backend of :class:`ppstate.rank_step.RankStep`.

The step order is :class:`~ppstate.rank_step.RankStep`'s, the one the runtime worker runs. This
backend keeps a "device" model per slot (owner, sampled-id history, ``num_computed_tokens``), the
rank's :class:`~ppstate.mirror.CpuMirror` and its KV cache (:mod:`ppstate.sim.kv`), and reports
ground truth to :class:`ppstate.oracle.invariants.InvariantOracle` as it goes. Hidden states are
modelled by rank 0's input token per row, handed rank to rank; the broadcast payload is a
:class:`~ppstate.payload.SampledPayload` over a numpy buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.mirror import CpuMirror
from ppstate.payload import SampledPayload
from ppstate.pp_handler import ConsumedEntry
from ppstate.rank_step import RankStep
from ppstate.sim.kv import SimKV
from ppstate.sim.spec_rank import SimSpec
from ppstate.oracle.model import model_token
from ppstate.oracle.slot_model import SlotTokens

if TYPE_CHECKING:
    from ppstate.oracle.invariants import InvariantOracle


@dataclass
class Wire:
    """What travels between simulated ranks, keyed by step.

    Attributes:
        outputs: step -> SchedulerOutput (every rank gets the same one).
        hidden: step -> ``[num_rows]`` rank 0's input token per row (stands for the hidden states
            handed rank to rank by p2p).
        broadcast: step -> the payload the last rank published (``[num_rows, width + 2]``; the
            side-group broadcast).
    """
    outputs: dict[int, SchedulerOutput] = field(default_factory=dict)
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    broadcast: dict[int, SampledPayload] = field(default_factory=dict)


class SimRank:
    """Device model of rank ``rank`` of ``pp_size`` (a :class:`~ppstate.rank_step.RankBackend`).

    Args:
        rank: PP rank.
        pp_size: stages.
        depth: PPHandler depth (pp_size overlapped, 1 sync).
        max_num_reqs: slots.
        checker: receives ground truth and records violations.
        kv_geometry: ``(max_model_len, num_blocks, block_size)`` of the KV cache model.
        spec: ``(K, acceptance)`` of speculative decoding (:mod:`ppstate.sim.spec`); K = 0: off.
    """

    def __init__(self, rank: int, pp_size: int, depth: int, max_num_reqs: int,
                 checker: "InvariantOracle",
                 kv_geometry: tuple[int, int, int] = (2048, 2048, 16),
                 spec: tuple[int, float] = (0, 0.0)) -> None:
        self.rank, self.is_last, self.checker = rank, rank == pp_size - 1, checker
        self.slot_tokens = SlotTokens(max_num_reqs)    # owners, token histories (shared model)
        self.eos_at = np.full(max_num_reqs, -1, dtype=np.int64)    # [max_num_reqs]
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] "device"
        self.mirror = CpuMirror(max_num_reqs, rank=rank)
        self.step_order = RankStep(self, rank, pp_size, depth, max_num_reqs)
        self.handler = self.step_order.handler
        self.kv = SimKV(rank, max_num_reqs, *kv_geometry, checker)
        self.spec = SimSpec(self, *spec) if spec[0] else None
        self.wire = Wire()
        self.next_index = 0         # index of the next step this rank runs among the issued ones
        self.busy_until = -1        # tick the running step ends (-1: idle)
        self.running: int | None = None
        self.finished: dict[int, int] = {}  # step -> tick it finished here
        self.busy_ticks = 0
        self.work_left = 0.0        # ticks of work of the running step still to do (contention)
        self.started = 0            # tick the running step started
        self.planned = 0            # its ticks without contention (busy_ticks counts them at start)

    def run_step(self, out: SchedulerOutput, wire: "Wire") -> StepResult | None:
        """Apply step ``out`` on this rank in the one order; the last rank returns the result."""
        self.wire = wire
        return self.step_order.step(out)

    # ---------------------------------------------------------------- RankBackend
    def begin_step(self, out: SchedulerOutput) -> None:
        """Nothing to reset: the simulator times steps outside the rank."""

    def free_and_admit(self, out: SchedulerOutput) -> None:
        self.slot_tokens.free_and_admit(out, self._check_owner)
        for n in out.new_requests:
            self.eos_at[n.slot] = n.sampling["eos_at"]
            self.num_computed[n.slot] = n.num_cached_tokens
            self.mirror.add_request(n.slot, len(n.prompt_token_ids), n.max_seq_len,
                                    n.num_cached_tokens)
            self.kv.on_new(n.slot)
        if self.spec is not None:
            self.spec.admit(out)
        self.kv.apply_deltas(out)
        self.kv.check_block_ids(out)

    def prepare_inputs(self, out: SchedulerOutput) -> np.ndarray | None:
        """Checks every row's input (invariants 2, 3); rank 0: ``[num_rows]`` input tokens."""
        st = self.slot_tokens
        self.checker.check_inputs(self.rank, out, st.owner, st.history)
        if self.spec is not None:
            return self.spec.prepare(out)
        return st.input_tokens(out) if self.rank == 0 else None

    def receive(self, out: SchedulerOutput) -> np.ndarray:
        return self.wire.hidden.pop(out.step)

    def forward(self, out: SchedulerOutput, inputs: np.ndarray | None,
                received: np.ndarray | None) -> np.ndarray:
        """KV writes and reads through the block table; the "hidden states" pass through."""
        hidden = inputs if received is None else received
        if self.spec is not None:
            self.kv.forward(out, self.spec.starts, hidden, self.spec.num_drafts)
        else:
            self.kv.forward(out)
        return hidden

    def send(self, out: SchedulerOutput, hidden: np.ndarray) -> None:
        self.wire.hidden[out.step] = hidden

    def apply_scheduled(self, out: SchedulerOutput) -> None:
        slots = out.slots.astype(np.int64)
        n = out.num_scheduled_tokens.astype(np.int64)
        np.add.at(self.num_computed, slots, n)
        self.mirror.apply_scheduled(slots, n)

    def sample(self, out: SchedulerOutput, mask: np.ndarray | None,
               logits: np.ndarray | None) -> SampledPayload:
        """The model's token for each final-chunk row, conditioned on rank 0's input token (with
        speculation: every position of the row verified, :meth:`SimSpec.sample`)."""
        if self.spec is not None:
            return self.spec.sample(out, logits)
        payload, st = SampledPayload.zeros(out.num_rows), self.slot_tokens
        for i in np.nonzero(out.is_final_chunk)[0].tolist():
            slot = int(out.slots[i])
            payload.token_ids[i, 0] = model_token(int(st.sample_seed[slot]),
                                                  len(st.history[slot]), int(logits[i]),
                                                  int(self.eos_at[slot]))
            payload.num_sampled[i] = 1
        self.checker.record_sampled(out, payload.token_ids[:, 0])
        return payload

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        src, st = self.wire.outputs[step], self.slot_tokens
        for i, idx in enumerate(idx_mapping.tolist()):
            if idx < 0:
                continue
            self.checker.check_apply(self.rank, step, src.req_ids[i], idx, st.owner[idx])
            st.history[idx].extend(payload.token_ids[i, :payload.num_sampled[i]].tolist())
        rejected = np.asarray(payload.num_rejected, dtype=np.int64)
        live = idx_mapping >= 0
        np.subtract.at(self.num_computed, idx_mapping[live], rejected[live])
        self.mirror.apply_rejected(idx_mapping, rejected)
        if self.spec is not None:
            self.spec.applied(step, idx_mapping, payload)

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                payload: SampledPayload) -> None:
        self.wire.broadcast[out.step] = payload
        self.checker.record_post(out, self.rank, mask is not None)

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> int:
        self.checker.record_post(out, self.rank, True, mask)
        return out.step

    def skip_receive(self, out: SchedulerOutput) -> None:
        self.checker.record_post(out, self.rank, False, None)

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        payload = self.wire.broadcast[entry.step]
        if self.spec is not None:
            self.spec.check_width(entry.step, payload)
        return payload

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        return StepResult(out.step, payload.token_ids.copy(),
                          payload.num_sampled.astype(np.int32),
                          payload.num_rejected.astype(np.int32))

    def sampled_ids(self, out: SchedulerOutput, payload: SampledPayload, result: StepResult):
        """The ``sampled`` event's ids (asked only when the step order traces to a sink)."""
        ids = {"token_ids": payload.token_ids.tolist(), "num_sampled": payload.num_sampled.tolist()}
        return (lambda: True), (lambda: ids)

    def end_step(self, out: SchedulerOutput) -> None:
        """Mirror ``num_computed_tokens`` of the step's rows against the device (invariant 4)."""
        if out.num_rows == 0:
            return
        slots = out.slots.astype(np.int64)
        bad = np.nonzero(self.mirror.num_computed_tokens_np[slots] != self.num_computed[slots])[0]
        if bad.size:
            i = int(bad[0])
            self.checker.violation(4, out.step, self.rank, f"mirror num_computed_tokens of slot "
                                   f"{int(slots[i])} differs from the device",
                                   slot=int(slots[i]), req_id=out.req_ids[i])

    def _check_owner(self, step: int, slot: int, want: str | None, have: str | None) -> None:
        self.checker.check_owner(self.rank, step, slot, want, have)
