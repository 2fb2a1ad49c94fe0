"""Replay of one PP rank: re-derive the rank's decisions from the recorded scheduler outputs and
results, in the order the runtime worker emits them (``docs/design.md`` §5), with a fresh
:class:`~ppstate.pp_handler.PPHandler`, :class:`~ppstate.mirror.CpuMirror` and slot-owner table.

Per step: ``rank.step`` -> deferred ``pp.consume`` (non-last ranks, overlapped) -> ``pp.free`` of
each freed slot -> empty step: ``pp.enqueue`` + ``broadcast.skipped``; otherwise the immediate
mirror update, then the last rank's ``broadcast.*`` and ``sampled``, or a non-last rank's
``pp.enqueue`` + ``broadcast.*`` -> ``mirror.check`` when mirrors are validated at this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.events import RecordingSink
from ppstate.mirror import CpuMirror
from ppstate.pp_handler import PPHandler, need_sampled_mask
from ppstate.trace.compare import ANY, Divergence, context_before, matches, normalise
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
    """Derives rank ``setup.rank``'s events for each step it ran.

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
        overlapped = setup.mode == "overlapped"
        self.handler = (PPHandler(setup.pp_size, setup.max_num_reqs, sink=self.sink,
                                  rank=setup.rank)
                        if overlapped and setup.pp_size > 1 and not self.is_last else None)
        self.mirror = CpuMirror(setup.max_num_reqs, rank=setup.rank)
        self.owner: list[str | None] = [None] * setup.max_num_reqs    # [max_num_reqs]

    # ---------------------------------------------------------------- derivation
    def run_step(self, out: SchedulerOutput) -> list[dict]:
        """Apply step ``out``; returns the events a correct rank emits for it."""
        start = len(self.sink.events)
        r, s = self.s.rank, out.step
        self.sink.emit("rank.step", step=s, rank=r, num_rows=out.num_rows)
        if self.handler is not None:
            entry = self.handler.consume()
            if entry is not None:
                self._apply_rejected(entry.step, entry.idx_mapping)
        for f in out.freed:
            self.owner[f.slot] = None
            if self.handler is not None:
                self.handler.on_slot_freed(f.slot, s)
        for n in out.new_requests:
            self.owner[n.slot] = n.req_id
            self.mirror.add_request(n.slot, len(n.prompt_token_ids), n.max_seq_len,
                                    n.num_cached_tokens)  # prefix-cache hit: already computed
        mask = need_sampled_mask(out)
        if out.is_empty:
            if self.handler is not None:
                self.handler.enqueue(s, out, None)
            if self.s.pp_size > 1:
                self.sink.emit("broadcast.skipped", step=s, rank=r)
        else:
            self.mirror.apply_scheduled(out.slots.astype(np.int64),
                                        out.num_scheduled_tokens.astype(np.int64))
            self._publish(out, mask)
        if self.s.validate_every and s % self.s.validate_every == 0:
            live = np.array([i for i, o in enumerate(self.owner) if o is not None], dtype=np.int64)
            self.sink.emit("mirror.check", step=s, rank=r, slots=live.tolist(),
                           num_computed_tokens=self.mirror.num_computed_tokens_np[live].tolist(),
                           ok=ANY, message=ANY)
        return self.sink.events[start:]

    def _publish(self, out: SchedulerOutput, mask: np.ndarray | None) -> None:
        r, s = self.s.rank, out.step
        if self.is_last:
            if self.s.pp_size > 1:
                self._broadcast(s, mask)
            res = self.results.get(s)
            self.sink.emit("sampled", step=s, rank=r, req_ids=list(out.req_ids),
                           token_ids=ANY if res is None else res["token_ids"],
                           num_sampled=ANY if res is None else res["num_sampled"])
            return
        if self.handler is not None:
            self.handler.enqueue(s, out, mask)
        self._broadcast(s, mask)
        if self.handler is None and mask is not None:  # sync: immediate consume
            self._apply_rejected(s, np.where(mask, out.slots, -1).astype(np.int64))

    def _broadcast(self, step: int, mask: np.ndarray | None) -> None:
        if mask is None:
            self.sink.emit("broadcast.skipped", step=step, rank=self.s.rank)
        else:
            self.sink.emit("broadcast.posted", step=step, rank=self.s.rank, rows=int(mask.sum()))

    def _apply_rejected(self, step: int, idx: np.ndarray) -> None:
        res = self.results.get(step)
        if res is not None:
            self.mirror.apply_rejected(idx, np.asarray(res["num_rejected"], dtype=np.int64))

    # ---------------------------------------------------------------- comparison
    def compare(self, recorded: list[dict],
                until: int | None = None) -> tuple[Divergence | None, int]:
        """Compare the rank's recorded decision events with the derived ones.

        The last recorded step may end early (a process stopped mid-step); anything else that
        differs is a divergence. Returns ``(divergence or None, steps compared)``.
        """
        rec = [e for e in recorded if e.get("kind") in RANK_DECISIONS]
        i, steps, expected_step = 0, 0, 0
        while i < len(rec):
            ev = rec[i]
            if ev["kind"] != "rank.step" or ev["step"] != expected_step:
                want = {"kind": "rank.step", "step": expected_step, "rank": self.s.rank}
                return self._diverge(rec, i, expected_step, want), steps
            if until is not None and expected_step > until:
                break
            out = self.outputs.get(expected_step)
            if out is None:  # the engine's recording ends before this rank's
                break
            self._check_consume(rec, i)
            for want in (normalise(e) for e in self.run_step(out)):
                if i >= len(rec):
                    return None, steps + 1       # truncated last step
                if not matches(want, rec[i]):
                    return self._diverge(rec, i, expected_step, want), steps
                i += 1
            steps += 1
            expected_step += 1
        return None, steps

    def _check_consume(self, rec: list[dict], i: int) -> None:
        """Invariant 2 on the recorded consume of this step: every applied row's slot is still
        owned by that row's request."""
        if self.checker is None or i + 1 >= len(rec) or rec[i + 1]["kind"] != "pp.consume":
            return
        ev = rec[i + 1]
        src = self.outputs.get(ev["step"])
        if src is None:
            return
        for row, slot in enumerate(ev["idx_mapping"]):
            if slot >= 0 and row < src.num_rows:
                self.checker.check_apply(self.s.rank, ev["step"], src.req_ids[row], slot,
                                         self.owner[slot])

    def _diverge(self, rec: list[dict], i: int, step: int, want: dict) -> Divergence:
        got = rec[i] if i < len(rec) else None
        return Divergence(step, self.s.rank, want.get("kind", "?"), got, want,
                          context_before(rec, i))
