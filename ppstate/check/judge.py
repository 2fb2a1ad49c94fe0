"""Judging a settled state beyond the monitor's invariants: deadlock (work left and nothing can
move) and the end of a run (every request arrived and none live: no op left unmatched, every
request closed for the client)."""

from __future__ import annotations

from ppstate.check.choices import Chooser
from ppstate.check.world import World


def system_can_move(w: World) -> bool:
    """Can the engine or a rank move without the environment (arrival, abort)? A settled world
    without ``--async`` / ``--no-por`` already ran every rank step and issue it could."""
    cfg = w.cfg
    if w.results:
        return True
    if cfg.por and not cfg.async_engine:
        return False
    if w.clone()._issue():
        return True
    return not cfg.por and any(w._runnable(r) and _try_rank(w, r) for r in range(w.pp_size))


def _try_rank(w: World, r: int) -> bool:
    c = w.clone()
    c.chooser = Chooser()
    return c._attempt(r)


def end_violations(w: World) -> list[dict]:
    """Deadlock and end-of-run checks of a settled state without violations."""
    if w.unfinished():
        if not system_can_move(w):
            return [{"invariant": 6, "step": w.sched.next_step, "rank": None,
                     "message": w.describe_stuck()}]
        return []
    if w.arrived == w.cfg.num_requests:
        left = w.comm.pending()
        if left:
            return [{"invariant": 1, "step": left[0].step, "rank": left[0].rank,
                     "message": "run ended with unmatched ops: " +
                     "; ".join(f"rank {o.rank} {o.describe()}" for o in left)}]
        # every arrived request has a record until it is closed and forgotten (canon.py)
        open_reqs = [rid for rid in w.monitor.delivered if rid not in w.monitor.inner.closed]
        if open_reqs:
            return [{"invariant": 3, "step": w.sched.next_step, "rank": None,
                     "message": f"run ended, the client never saw {open_reqs} finish"}]
    return []
