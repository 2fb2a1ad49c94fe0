"""Invariant checks of a replayed trace, on what the recording says happened.

Reuses :class:`~ppstate.oracle.invariants.InvariantOracle` where its rules need no
ground truth beyond the trace: budgets, balance and cadence of each issued step (invariants 5, 7),
collective matching of the recorded broadcast decisions (1) and no stale application of the
recorded deferred consumes (2). On top: nothing delivered after a request finished (3), every
recorded mirror check passed (4), and for simulator traces liveness at the end (6).
"""

from __future__ import annotations

from collections import defaultdict

from ppstate.batch import SchedulerOutput
from ppstate.scheduler import Scheduler
from ppstate.oracle.invariants import InvariantOracle
from ppstate.codec import decode_output


class _NoState:
    """Stands in for the scheduler after a divergence, so state-based rules stay silent."""

    class slots:  # noqa: N801 - mimics Scheduler.slots
        num_allocated = 0
        num_free = 0

    num_waiting = 0
    lanes = 1  # balanced cap = max_num_seqs: the row rule stays silent too

    class kv:  # noqa: N801 - mimics Scheduler.kv (the block pool is not known after a divergence)
        class pool:  # noqa: N801
            @staticmethod
            def check_invariants() -> None:
                return None


class TraceOracle:
    """Collects invariant violations while a trace is replayed.

    Args:
        sched: the replay scheduler (its state right after each matched ``schedule`` event).
        pp_size: stages (a broadcast decision is complete once every rank's is in).
    """

    def __init__(self, sched: Scheduler, pp_size: int) -> None:
        self.inner = InvariantOracle((), sched)
        self.pp_size = pp_size
        self._finished: dict[str, str] = {}
        self._posts: dict[int, int] = defaultdict(int)
        self._outputs: dict[int, SchedulerOutput] = {}  # step -> recorded output (engine first)

    @property
    def violations(self) -> list[dict]:
        return [v.as_dict() for v in self.inner.violations]

    def detach_scheduler(self) -> None:
        """After a divergence the replay scheduler no longer mirrors the recording."""
        self.inner.sched = _NoState()

    # ---------------------------------------------------------------- engine events
    def on_engine_event(self, ev: dict) -> None:
        """Feed one recorded scheduler event (in recorded order)."""
        kind = ev["kind"]
        if kind == "arrival":
            self.inner.prompt_len[ev["req_id"]] = ev["prompt_len"]
            self._finished.pop(ev["req_id"], None)  # a finished request's id used again
        elif kind == "schedule":
            out = decode_output(ev["output"])
            self._outputs[out.step] = out
            self.inner.on_issue(out)
        elif kind == "tokens":
            for u in ev["updates"]:
                rid = u["req_id"]
                if rid in self._finished:
                    self.inner.violation(3, ev["of_step"], None, f"{rid} got {u['token_ids']} "
                                         f"after it finished ({self._finished[rid]})")
                elif u["finish_reason"] is not None:
                    self._finished[rid] = u["finish_reason"]
        elif kind == "lifecycle" and ev["trigger"] == "abort":
            self._finished.setdefault(ev["req_id"], "abort")

    # ---------------------------------------------------------------- rank events
    def on_rank_event(self, ev: dict) -> None:
        """Feed one recorded rank event (any order across ranks)."""
        kind = ev["kind"]
        if kind in ("broadcast.posted", "broadcast.skipped"):
            out = self._outputs.get(ev["step"])
            if out is not None:  # a rank's step the engine's recording does not reach is
                self.inner.record_post(out, ev["rank"], kind == "broadcast.posted")  # not judged
        elif kind == "mirror.check" and not ev.get("ok", True):
            msg = ev.get("message") or "mirror differs"
            self.inner.violation(9 if "block_ids" in msg else 4, ev["step"], ev["rank"], msg)

    def check_apply(self, rank: int, step: int, row_req: str, slot: int, owner: str | None) -> None:
        self.inner.check_apply(rank, step, row_req, slot, owner)

    def finish(self, sched: Scheduler, step: int) -> None:
        """Liveness (6) at the end of a run that ran to completion (simulator traces)."""
        if sched.has_unfinished() or sched.in_flight:
            self.inner.violation(6, step, None, f"run ended with {sched.num_running} running, "
                                 f"{sched.num_waiting} waiting, {sched.in_flight} steps in flight")
