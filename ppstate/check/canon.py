"""Canonical state keys of the model checker: what two worlds must agree on to have one future.

Keyed by the digest of a world's whole pickle (``--no-canon``), two worlds that differ only in
history (which finished request got which tokens, how many steps and admissions came before) never
merge and the state graph is nearly a tree. :func:`scrub` rewrites a world in place into its
canonical form, a valid world with the same future: the explorer runs the real code on that form
from then on, and :func:`canonical` returns its pickle (the frontier entry) and that pickle's 64-bit
fingerprint (the key). ``ppstate.check.verify`` tests that the rules below keep verdicts and
futures. docs/checker.md argues each rule; in short:

* **Dead requests are forgotten.** A request is dead when the client saw it end (``closed`` in
  the monitor), the scheduler no longer holds it (not live), and no rank slot, issued step still
  kept, undelivered result or queued op names it. Its future influence is then nil: the checker
  offers no action on it (abort only targets live ids, ids are never reused), no row of it can
  reach a rank, the scheduler or the client again, and the end-of-run check only asks whether
  every arrived request is closed (dead implies closed, and the arrival count stays in the key).
  Forgotten: the monitor's per-request records
  (delivered tokens, max_tokens, ignore_eos, prompt length, admission, sampling steps, sampled
  tokens, received, closed) and its row admissions.
* **The scheduler's finished history is forgotten** (every entry): only
  ``Scheduler.state_of`` reads it, a client query that neither the scheduler's decisions nor any
  checker path calls.
* **How a freed slot's request finished** (length, stop, abort) is forgotten in the issued steps
  the world still keeps; preempted or not is kept. The one reader of the reason, the monitor's
  ``on_issue`` (no admission check for a preemption), runs when the step is issued; ranks read a
  freed entry's slot and request id only.
* **Write-only statistics are forgotten**: scheduler counters (prefill tokens, preemptions, spec
  counters), the block pool's lookup counters; the monitor's post log is already cleared; the
  ranks' op and choice log cursors (reset when a step starts or re-runs, before any read).
* **A free slot's per-request rank fields are forgotten** (history, output cap, seed, EOS flags,
  last prompt token): :meth:`CheckRank.apply_freed_new` rewrites all of them on admission, and
  nothing reads them while the slot is free.
* **Admission epochs are renumbered** by rank among the values still present (live requests' and
  in-flight rows'): the scheduler only compares epochs for equality and every new epoch is larger
  than all others, so an order-preserving renaming keeps every comparison's outcome.

* **A free slot's scheduler and rank arrays are forgotten** (``RequestArrays`` fields, the CPU
  mirror's and the device counters' per-slot values): admission rewrites each of them
  (``RequestArrays.reset``, ``CpuMirror.add_request``, ``CheckRank.apply_freed_new``) and only live
  slots are read or validated. ``Request.order`` and its counter are read by nothing. When every
  request arrived and none is live, no slot is allocated again and the scheduler's free list is
  sorted (its order only decides which slot an admission gets).
* **Steps, op indices, slot generations and KV block ids are renamed**
  (:mod:`ppstate.check.renumber`).

The explorer continues from the scrubbed world itself (it is a valid world with the same future),
so one pickle per transition is both the frontier entry and, hashed, the key. Since step numbers
are relative, the explorer replaces the absolute step bound by a cycle check (docs/checker.md).
"""

from __future__ import annotations

import numpy as np

from ppstate.check import block_ids
from ppstate.check import leftovers, renumber, slot_labels
from ppstate.check.snapshot import dumps, fingerprint
from ppstate.mirror import MIRROR_FIELDS


def _named(w) -> set[str]:
    """Request ids some part of the system can still act on or deliver."""
    names = set(w.sched.queues.live)
    for out in w.outputs.values():
        names.update(out.req_ids)
    for out in w.sched.results.in_flight:
        names.update(out.req_ids)
    for rk in w.ranks:
        names.update(o for o in rk.slot_tokens.owner if o is not None)
    names.update(f.req_id for f in w.sched.queues.freed)
    return names


def _dead(w) -> set[str]:
    closed = w.monitor.inner.closed
    named = _named(w)
    return {rid for rid in closed if rid not in named}


def _forget_requests(w, dead: set[str]) -> None:
    sched, mon, inner = w.sched, w.monitor, w.monitor.inner
    sched.queues.finished.clear()     # read only by Scheduler.state_of, which no checker path calls
    for rid in dead:
        for d in (mon.delivered, mon.max_tokens, mon.ignore_eos, inner.prompt_len,
                  inner.admission, inner.sampling_steps, inner.sampled_by_last, inner.received,
                  inner.closed):
            d.pop(rid, None)
    for key in [k for k in inner.row_admission if k[1] in dead]:
        del inner.row_admission[key]


def _forget_freed_reasons(w) -> None:
    outs = list(w.outputs.values()) + list(w.sched.results.in_flight)
    for f in {id(f): f for out in outs for f in out.freed}.values():
        if f.reason != "preempted":
            object.__setattr__(f, "reason", "finished")


def _forget_old_steps(w) -> None:
    """Issued steps no rank will read again: a rank reads ``outputs[s]`` for its own steps
    (``s >= next_step``) and for the step of each deferred entry it still holds (the payload's
    owners, the wait's progress rule); the monitor's row admissions are read for those steps too.
    The scheduler's own in-flight steps are its state and stay."""
    low = min(rk.next_step for rk in w.ranks)
    keep = {s for s in w.outputs if s >= low}
    for rk in w.ranks:
        if rk.handler is not None:
            keep.update(e.step for e in rk.handler._fifo if e is not None)
    for s in [s for s in w.outputs if s not in keep]:
        del w.outputs[s]
    rows = w.monitor.inner.row_admission
    for key in [k for k in rows if k[0] not in keep]:
        del rows[key]


def _forget_stats(w) -> None:
    s = w.sched
    s.queues.num_preemptions = s.num_prefill_tokens = s.results.num_discarded_rows = 0
    r = s.results
    r.num_spec_rejected = r.num_spec_proposed = r.num_spec_rows = 0
    pool = s.kv.pool
    pool.query_tokens = pool.hit_tokens = 0
    w.monitor.inner.post_log.clear()   # the simulator's write-only log of broadcast decisions
    s.lanes = s.config.pp_size         # written by schedule() before any read
    for rk in w.ranks:                 # log cursors: reset by begin_attempt before any read
        rk._cursor = rk._choice_cursor = 0
        if rk.handler is not None:     # a write-only counter (the runtime exports it)
            rk.handler.num_dropped = 0


def _forget_free_slots(w) -> None:
    for rk in w.ranks:
        for s, owner in enumerate(rk.slot_tokens.owner):
            if owner is None:
                leftovers.clear_rank_slot(rk, s, MIRROR_FIELDS)
    sched = w.sched
    free = np.array([s for s, o in enumerate(sched.slots.owner) if o is None], dtype=np.int64)
    if free.size:
        for f in sched.arrays.FIELDS:
            getattr(sched.arrays, f)[free] = 0
    sched._arrivals = 0
    for r in sched.queues.live.values():
        r.order = 0
    _sort_free_list(w)


def _sort_free_list(w) -> None:
    """No slot can be allocated again once every request arrived and none is live (only a live
    waiting request is admitted): the free list's order, which decides which slot the next
    admission gets, is read by nothing."""
    if not w.sched.queues.live and w.arrived == w.cfg.num_requests:
        w.sched.slots._free.sort(reverse=True)


def _renumber_epochs(w) -> None:
    """Admission epochs: the occupants' epochs by rank (1, 2, ...); an in-flight row whose epoch is
    not its slot's occupant's now never matches again (a slot's epoch only changes to 0 or a
    fresh, larger epoch): -1, which no slot has; a waiting request's (preempted) is rewritten on
    admission: 0."""
    s = w.sched
    old = s.views.slot_epoch.copy()                                    # [max_num_reqs]
    values = sorted(set(old.tolist()) - {0})
    rank = {v: i + 1 for i, v in enumerate(values)}
    for r in s.queues.live.values():
        r.epoch = rank[r.epoch] if r.slot >= 0 else 0
    s.views.slot_epoch[:] = [rank.get(e, 0) for e in old.tolist()]
    for i, (out, rows) in enumerate(zip(s.results.in_flight, s.results.in_flight_epochs)):
        slots = out.slots.astype(np.int64)
        fresh = (np.asarray(rows, dtype=np.int64) == old[slots]) & (old[slots] != 0)
        s.results.in_flight_epochs[i] = np.where(fresh, s.views.slot_epoch[slots], -1).astype(np.int64)
    s.queues.admissions = len(values)


def scrub(w) -> None:
    """Rewrite ``w`` into its canonical form (a world with the same future)."""
    _forget_old_steps(w)
    leftovers.empty_run_steps(w)
    _forget_requests(w, _dead(w))
    _forget_freed_reasons(w)
    _forget_stats(w)
    _forget_free_slots(w)
    _renumber_epochs(w)
    ops = renumber.ops_of(w)
    renumber.shift_steps(w, ops)
    leftovers.settle_leftovers(w)
    renumber.trim_sampling_history(w)
    renumber.shift_comm(w, ops)
    renumber.renumber_generations(w)
    renumber.rename_blocks(w)
    block_ids.zero_block_ids(w)
    orders = slot_labels.canonical_orders(w)
    current = _label(w, orders[0], list(range(len(orders[0]))))
    if len(orders) > 1:   # free slots with nothing to tell them apart but leftovers: the least
        best, best_key = current, fingerprint(dumps(w))
        for order in orders[1:]:
            current = _label(w, order, current)
            key = fingerprint(dumps(w))
            if key < best_key:
                best, best_key = order, key
        if best is not current:
            _label(w, best, current)


def _label(w, order: list[int], current: list[int]) -> list[int]:
    """Relabel ``w``, labelled ``current`` now (new slot -> slot before scrubbing), as ``order``
    (likewise), sort the free list and name the leftovers; returns ``order``."""
    where = {orig: k for k, orig in enumerate(current)}
    slot_labels.relabel(w, [where[orig] for orig in order])
    _sort_free_list(w)
    leftovers.name_leftovers(w)
    return order


def canonical(w) -> tuple[bytes, int]:
    """Scrub ``w`` in place; returns its pickle and the 64-bit fingerprint of that pickle."""
    scrub(w)
    data = dumps(w)
    return data, fingerprint(data)


def canonical_key(w) -> int:
    """64-bit key of ``w``'s future (module docstring); scrubs ``w`` in place."""
    return canonical(w)[1]
