"""Invariant and progress checks of the model checker, fed by the ranks, the scheduler and the
client side of one explored world.

Reuses :class:`~ppstate.oracle.invariants.InvariantOracle` for the rules that need no
fixed workload: budgets, balance and cadence of each issued step and the block pool (7, 5, 9, via
``on_issue``), the broadcast decision of every rank against an independent statement of the rule
and across ranks (1, ``record_post``), slot ownership on free / admit and on deferred apply (2),
and every decode input against the last rank's previous sample (3, ``check_inputs``). On top:

* exactly-once, in-order delivery to the client, with the right finish reason (3);
* mirror agreement, KV completeness and block-id agreement as reported by each rank's
  ``mirror.check`` (4, 8, 9);
* collective mismatches from :class:`~ppstate.check.comm.Comm` (1);
* progress in overlapped mode (reported as invariant 6, liveness): no rank waits for a broadcast
  that no row of its step needs (also a broken invariant 1: the broadcast was posted), and no rank
  running a step s that holds a non-final chunk waits for the last rank's step t > s - pp_size
  (the prompt's next chunk could not enter rank 0 in step s + 1);
* deadlock and unfinished work are judged by the explorer (:mod:`ppstate.check.explore`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ppstate.events import EventSink
from ppstate.request import TokenUpdate
from ppstate.scheduler import Scheduler
from ppstate.oracle.invariants import InvariantOracle

if TYPE_CHECKING:
    from ppstate.batch import SchedulerOutput
    from ppstate.check.comm import Op


class Monitor:
    """All checks of one world; ``violations`` lists what broke (dicts, first first)."""

    def __init__(self, sched: Scheduler, world: Any) -> None:  # world: ppstate.check.world.World
        self.inner = InvariantOracle((), sched)
        self.world = world
        self.delivered: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.ignore_eos: dict[str, bool] = {}

    @property
    def violations(self) -> list[dict]:
        return [v.as_dict() for v in self.inner.violations]

    def violation(self, invariant: int, step: int, rank: int | None, message: str) -> None:
        self.inner.violation(invariant, step, rank, message)

    # ---------------------------------------------------------------- scheduler / client side
    def on_arrival(self, req_id: str, prompt_len: int, max_tokens: int, ignore_eos: bool) -> None:
        self.inner.prompt_len[req_id] = prompt_len
        self.delivered[req_id] = []
        self.max_tokens[req_id] = max_tokens
        self.ignore_eos[req_id] = ignore_eos
        self.inner.closed.pop(req_id, None)

    def on_issue(self, out: "SchedulerOutput") -> None:
        self.inner.on_issue(out)
        self.inner.post_log.clear()   # write-only log; kept out of the state

    def on_abort(self, req_id: str) -> None:
        self.inner.closed[req_id] = "abort"

    def on_updates(self, step: int, updates: list[TokenUpdate]) -> None:
        """Exactly-once, in-order delivery of what the last rank sampled; finish reasons."""
        for u in updates:
            rid = u.req_id
            if rid in self.inner.closed:
                self.violation(3, step, None, f"{rid} got {u.token_ids} after it finished "
                               f"({self.inner.closed[rid]})")
                continue
            got = self.delivered[rid]
            got.extend(u.token_ids)
            truth = self.inner.sampled_by_last[rid]
            want = [truth.get(k) for k in range(len(got))]
            if got != want:
                self.violation(3, step, None, f"{rid} received {got}, the last rank sampled {want}")
            if u.finish_reason is None:
                continue
            self.inner.closed[rid] = u.finish_reason
            eos = bool(got) and got[-1] == 2 and not self.ignore_eos[rid]
            ok = (u.finish_reason == "stop" and eos) or \
                (u.finish_reason == "length" and not eos and len(got) == self.max_tokens[rid])
            if not ok:
                self.violation(3, step, None, f"{rid} finished {u.finish_reason} after {len(got)} "
                               f"tokens ending {got[-1:]} (max_tokens {self.max_tokens[rid]})")

    # ---------------------------------------------------------------- rank side
    def check_owner(self, rk: Any, step: int, slot: int, want: str | None) -> None:
        self.inner.check_owner(rk.rank, step, slot, want, rk.slot_tokens.owner[slot])

    def check_apply(self, rk: Any, step: int, row_req: str, slot: int) -> None:
        self.inner.check_apply(rk.rank, step, row_req, slot, rk.slot_tokens.owner[slot])

    def check_inputs(self, rk: Any, out: "SchedulerOutput") -> None:
        self.inner.check_inputs(rk.rank, out, rk.slot_tokens.owner, rk.slot_tokens.history)

    def record_sampled(self, out: "SchedulerOutput", tokens: np.ndarray) -> None:
        self.inner.record_sampled(out, tokens)

    def on_event(self, ev: dict[str, Any]) -> None:
        """A rank's trace event: broadcast decisions (1) and mirror checks (4, 8)."""
        kind = ev["kind"]
        if kind in ("broadcast.posted", "broadcast.skipped"):
            out = self.world.outputs[ev["step"]]
            self.inner.record_post(out, ev["rank"], kind == "broadcast.posted")
        elif kind == "mirror.check" and not ev["ok"]:
            msg = ev["message"] or "mirror differs from the device"
            inv = 9 if "block_ids" in msg else 8 if "num_blocks" in msg else 4
            self.violation(inv, ev["step"], ev["rank"], msg)

    def on_wait(self, rk: Any, op: "Op") -> None:
        """Progress rules for a blocking wait on a broadcast (overlapped mode)."""
        if op.kind != "bcast" or not rk.overlapped or self.world.pp_size == 1:
            return
        s, t = rk.running_step, op.step
        need = self.inner.rows_needing_sample(self.world.outputs[t])
        if not need.any():
            self.violation(1, t, rk.rank, f"rank {rk.rank} posted and waits for the broadcast of "
                           f"step {t}, which no row needs (all non-final chunks)")
            self.violation(6, s, rk.rank, f"progress: rank {rk.rank} waits at step {s} for a "
                           f"broadcast it does not need (step {t})")
        elif t > s - rk.depth and not self.world.outputs[s].is_final_chunk.all():
            chunk = self.world.outputs[s].req_ids[int(np.argmin(self.world.outputs[s].is_final_chunk))]
            self.violation(6, s, rk.rank, f"progress: rank {rk.rank} waits at step {s} for the "
                           f"last rank's step {t} (> {s} - {rk.depth}): the next chunk of "
                           f"{chunk} cannot enter rank 0 in step {s + 1}")

    def on_mismatch(self, message: str, step: int) -> None:
        self.violation(1, step, None, message)


class MonitorSink(EventSink):
    """A rank's event sink: feeds :meth:`Monitor.on_event`; keeps the events when recording."""

    enabled = True

    def __init__(self, monitor: Monitor, record: bool) -> None:
        self.monitor, self.record = monitor, record
        self.events: list[dict[str, Any]] = []

    def __deepcopy__(self, memo: dict) -> "MonitorSink":
        return self   # a rank's snapshot shares its sink

    def emit(self, kind: str, step: int = -1, rank: int | None = None, **data: Any) -> None:
        ev = {"kind": kind, "step": step, "rank": rank, **data}
        self.monitor.on_event(ev)
        if self.record:
            self.events.append(ev)
