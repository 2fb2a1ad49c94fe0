"""Replay of one PP rank: re-derive the rank's decisions from the recorded scheduler outputs and
results by running the runtime's own step order (:class:`~ppstate.rank_step.RankStep`) over a
recording backend, with a fresh :class:`~ppstate.pp_handler.PPHandler` (depth ``pp_size``
overlapped, 1 sync), :class:`~ppstate.mirror.CpuMirror` and slot-owner table.

Per step: ``rank.step`` -> for each number the scheduler skipped before the step, the deferred
``pp.consume`` of that number's turn and an empty ``pp.enqueue`` (non-last ranks) -> the step's
deferred ``pp.consume`` (non-last ranks) -> ``pp.free`` of each freed
slot -> the immediate mirror update (non-empty steps) -> the last rank's ``broadcast.*`` and
``sampled``, or a non-last rank's ``broadcast.posted`` + ``pp.enqueue`` (``pp.enqueue`` +
``broadcast.skipped`` when no row needs a sample) -> ``mirror.check`` when mirrors are validated
at this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.events import RecordingSink
from ppstate.mirror import CpuMirror
from ppstate.payload import SampledPayload
from ppstate.pp_handler import ConsumedEntry
from ppstate.rank_step import RankStep
from ppstate.replay.compare import ANY, Divergence, context_before, matches, normalise
from ppstate.trace.models import RANK_DECISIONS


@dataclass
class RankSetup:
    """What a rank's replay needs besides the events.

    Attributes:
        rank: PP rank; pp_size: stages; mode: ``overlapped`` or ``sync``.
        max_num_reqs: slots. validate_every: mirror validation period in steps (0: never).
    """
    rank: int
    pp_size: int
    mode: str
    max_num_reqs: int
    validate_every: int


class RankReplay:
    """Derives rank ``setup.rank``'s events for each step it ran (a
    :class:`~ppstate.rank_step.RankBackend` whose operations emit what the runtime's emit).

    Args:
        setup: rank parameters.
        outputs: step -> recorded SchedulerOutput.
        results: step -> recorded result event (``token_ids``, ``num_sampled``, ``num_rejected``).
        checker: receives invariant-2 checks of the recorded consumes (``check_apply``).
    """

    def __init__(self, setup: RankSetup, outputs: dict[int, SchedulerOutput],
                 results: dict[int, dict[str, Any]], checker=None) -> None:
        self.s, self.outputs, self.results, self.checker = setup, outputs, results, checker
        self.is_last = setup.rank == setup.pp_size - 1
        self.sink = RecordingSink()
        depth = setup.pp_size if setup.mode == "overlapped" else 1
        self.step_order = RankStep(self, setup.rank, setup.pp_size, depth, setup.max_num_reqs,
                              self.sink)
        self.handler = self.step_order.handler
        self.mirror = CpuMirror(setup.max_num_reqs, rank=setup.rank)
        self.owner: list[str | None] = [None] * setup.max_num_reqs    # [max_num_reqs]

    # ---------------------------------------------------------------- derivation
    def run_step(self, out: SchedulerOutput) -> list[dict]:
        """Apply step ``out``; returns the events a correct rank emits for it."""
        start = len(self.sink.events)
        self.step_order.step(out)
        return self.sink.events[start:]

    def _payload(self, step: int, num_rows: int) -> SampledPayload:
        """The recorded payload of ``step`` (zeros when its result was not recorded)."""
        res = self.results.get(step)
        p = SampledPayload.zeros(num_rows)
        if res is not None:
            p.num_rejected[:] = np.asarray(res["num_rejected"], dtype=np.int64)
        return p

    # RankBackend: the step order records the decisions; these apply what the recording implies
    def begin_step(self, out: SchedulerOutput) -> None:
        return None

    def free_and_admit(self, out: SchedulerOutput) -> None:
        for f in out.freed:
            self.owner[f.slot] = None
        for n in out.new_requests:
            self.owner[n.slot] = n.req_id
            self.mirror.add_request(n.slot, len(n.prompt_token_ids), n.max_seq_len,
                                    n.num_cached_tokens)  # prefix-cache hit: already computed

    def prepare_inputs(self, out: SchedulerOutput) -> None:
        return None

    def receive(self, out: SchedulerOutput) -> None:
        return None

    def forward(self, out: SchedulerOutput, inputs: Any, received: Any) -> None:
        return None

    def send(self, out: SchedulerOutput, hidden: Any) -> None:
        return None

    def apply_scheduled(self, out: SchedulerOutput) -> None:
        self.mirror.apply_scheduled(out.slots.astype(np.int64),
                                    out.num_scheduled_tokens.astype(np.int64))

    def sample(self, out: SchedulerOutput, mask: np.ndarray | None, logits: Any) -> SampledPayload:
        return self._payload(out.step, out.num_rows)

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        if step in self.results:
            self.mirror.apply_rejected(idx_mapping, np.asarray(payload.num_rejected))

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                payload: SampledPayload) -> None:
        return None

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> None:
        return None

    def skip_receive(self, out: SchedulerOutput) -> None:
        return None

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        return self._payload(entry.step, len(entry.idx_mapping))

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        return StepResult(out.step, payload.token_ids.copy(),
                          payload.num_sampled.astype(np.int32),
                          payload.num_rejected.astype(np.int32))

    def sampled_ids(self, out: SchedulerOutput, payload: SampledPayload, result: StepResult):
        res = self.results.get(out.step)    # recorded ids, or any when the result was not
        ids = {"token_ids": ANY if res is None else res["token_ids"],
               "num_sampled": ANY if res is None else res["num_sampled"]}
        return (lambda: True), (lambda: ids)

    def end_step(self, out: SchedulerOutput) -> None:
        s = out.step
        if self.s.validate_every and s % self.s.validate_every == 0:
            live = np.array([i for i, o in enumerate(self.owner) if o is not None], dtype=np.int64)
            self.sink.emit("mirror.check", step=s, rank=self.s.rank, slots=live.tolist(),
                           num_computed_tokens=self.mirror.num_computed_tokens_np[live].tolist(),
                           ok=ANY, message=ANY)

    # ---------------------------------------------------------------- comparison
    def compare(self, recorded: list[dict],
                until: int | None = None) -> tuple[Divergence | None, int]:
        """Compare the rank's recorded decision events with the derived ones.

        The last recorded step may end early (a process stopped mid-step); anything else that
        differs is a divergence. Returns ``(divergence or None, steps compared)``.
        """
        rec = [e for e in recorded if e.get("kind") in RANK_DECISIONS]
        issued = iter(sorted(self.outputs))   # skipped numbers are not steps of any rank
        i, steps = 0, 0
        while i < len(rec):
            expected_step = next(issued, None)
            if expected_step is None:  # the engine's recording ends before this rank's
                break
            ev = rec[i]
            if ev["kind"] != "rank.step" or ev["step"] != expected_step:
                want = {"kind": "rank.step", "step": expected_step, "rank": self.s.rank}
                return self._diverge(rec, i, expected_step, want), steps
            if until is not None and expected_step > until:
                break
            self._check_consume(rec, i)
            for want in (normalise(e) for e in self.run_step(self.outputs[expected_step])):
                if i >= len(rec):
                    return None, steps + 1       # truncated last step
                if not matches(want, rec[i]):
                    return self._diverge(rec, i, expected_step, want), steps
                i += 1
            steps += 1
        return None, steps

    def _check_consume(self, rec: list[dict], i: int) -> None:
        """Invariant 2 on the recorded consumes of the step starting at ``rec[i]`` (its own and
        those of numbers skipped before it): every applied row's slot is still owned by that
        row's request."""
        if self.checker is None:
            return
        for ev in rec[i + 1:]:
            if ev["kind"] == "rank.step":
                return
            src = self.outputs.get(ev["step"]) if ev["kind"] == "pp.consume" else None
            if src is None:
                continue
            for row, slot in enumerate(ev["idx_mapping"]):
                if slot >= 0 and row < src.num_rows:
                    self.checker.check_apply(self.s.rank, ev["step"], src.req_ids[row], slot,
                                             self.owner[slot])

    def _diverge(self, rec: list[dict], i: int, step: int, want: dict) -> Divergence:
        got = rec[i] if i < len(rec) else None
        return Divergence(step, self.s.rank, want.get("kind", "?"), got, want,
                          context_before(rec, i))
