"""Canonical form of the requests the scheduler no longer holds but the pipeline still names
(*leftovers*: finished or aborted, with rows in kept steps, slots not yet freed on some rank, a
free not yet issued, or results not yet delivered), and of the steps every rank has run.

A request leaves the scheduler when it finishes or is aborted; the ranks still run the rows it had
in flight, free its slot a step later and the scheduler still receives (and drops) its results.
Until then the world keeps its token ids, seed, prompt and the client's record, so two histories
that differ only in how a request ended (EOS or length, which token, when it was aborted) stay
apart for several steps. docs/checker.md argues each rule; in short:

* **Steps every rank has run** (``step < min(next_step)``) are read again only through their rows:
  the scheduler's result handling reads ``slots``, ``is_final_chunk``, ``req_ids`` and the row
  count, a deferred consume reads ``req_ids`` (the owner check) and the progress rule reads the
  rows' positions and lengths. Their ``new_requests``, ``freed`` and block-table deltas were read
  when the ranks ran the step: emptied.
* **A leftover is settled** when no step some rank has not run yet has a row or the admission of
  it (a free in such a step only compares its id with the slot's owner) and the client has seen it
  end (or its record is already forgotten). Settled stays settled: the scheduler schedules no
  row of a request it no longer holds. Its rows in the
  pipeline then stay where they are: the scheduler will not schedule it (it no longer holds it) and
  drops its results (``StepResults._live_rows``: the row's epoch no longer matches its slot's), and
  the ranks only free its slot, apply its deferred rows to that slot (owner check, counters) and
  validate the slot's counters. So what only its own future rows or a live client would read goes:
  its token ids in undelivered results and in deferred broadcast payloads become 0 (the rows'
  counts and rejected tokens stay: the mirrors apply them), its slots' per-request rank fields
  (token history, seed, output cap, EOS flags, last prompt token) are cleared, the slots' mirror
  and device counters that no row changes again become 0 on both sides (prefill length,
  ``max_seq_len``, prefill progress, blocks; ``num_computed_tokens`` too without speculative
  tokens: only a rejection moves it; validation compares mirror with device, which a step that
  made them differ already reported, and blocks with ``ceil(computed / block_size)``, 0 = 0),
  and the monitor's
  records that only a future row or delivery reads (tokens delivered and sampled, max_tokens,
  ignore_eos, admission, sampling steps; a delivery to a closed request is a violation whatever it
  carries) are dropped. The finish reason becomes ``closed`` (read only in a message), its rows'
  admissions keep only the prefill length (:meth:`InvariantOracle.rows_needing_sample` reads it)
  and its prompt length becomes 0 (read only as the default of a row-admission lookup, which hits
  for every row of a kept step).
* **Settled leftovers are renamed** ``z0, z1, ...`` in the order they first appear (steps in
  order, their rows and frees, then the ranks' slot owners, then the frees not yet issued): after
  the erasure an id is only compared for equality (owner checks, the scheduler's frees), never
  used to act (aborts name live requests) and never derives content; ``z`` ids never collide with
  the ``r<i>`` ids of live or future requests.
"""

from __future__ import annotations

import numpy as np

from ppstate.check.renumber import _outputs
from ppstate.mirror import MIRROR_FIELDS

def _unrun(w) -> int:
    """The oldest step some rank has not run."""
    return min(rk.next_step for rk in w.ranks)


def empty_run_steps(w) -> None:
    """Empty the admission, free and block-table fields of steps every rank has run."""
    low = _unrun(w)
    for out in _outputs(w):
        if out.step < low and (out.new_requests or out.freed or out.block_table_slots.size):
            object.__setattr__(out, "new_requests", ())
            object.__setattr__(out, "freed", ())
            for f in ("block_table_slots", "block_table_cols", "block_table_ids"):
                # one array each: a shared one would pickle (memoize) differently
                object.__setattr__(out, f, np.zeros(0, dtype=np.int32))


def _first_seen(w, outs: list) -> list[str]:
    """Every request id the world names but the scheduler does not hold, in canonical order."""
    live, seen = w.sched.queues.live, {}
    for out in outs:
        for rid in list(out.req_ids) + [f.req_id for f in out.freed] + \
                [n.req_id for n in out.new_requests]:
            seen.setdefault(rid, None)
    for rk in w.ranks:
        for rid in rk.slot_tokens.owner:
            if rid is not None:
                seen.setdefault(rid, None)
    for f in w.sched.queues.freed:
        seen.setdefault(f.req_id, None)
    return [rid for rid in seen if rid not in live]


def settled(w, outs: list) -> list[str]:
    """Leftovers no unrun step names and whose end the client saw (module docstring)."""
    low, mon = _unrun(w), w.monitor
    busy = set()
    for out in outs:
        if out.step >= low:   # a free in an unrun step only compares the id with the owner
            busy.update(out.req_ids)
            busy.update(n.req_id for n in out.new_requests)
    return [rid for rid in _first_seen(w, outs) if rid not in busy and
            (rid in mon.inner.closed or rid not in mon.delivered)]


def _erase_rows(w, by_step: dict, gone: set[str]) -> None:
    fixed = [f for f in MIRROR_FIELDS if f != "num_computed_tokens" or not w.spec_tokens]
    for res in w.results:
        for i, rid in enumerate(by_step[res.step].req_ids):
            if rid in gone:
                res.sampled_token_ids[i, :] = 0
    for rk in w.ranks:
        for s, rid in enumerate(rk.slot_tokens.owner):
            if rid in gone:   # fixed: equal on mirror and device (validated), never change again
                clear_rank_slot(rk, s, fixed)
        if rk.handler is None:
            continue
        for e in rk.handler._fifo:
            got = None if e is None else getattr(getattr(e.handle, "op", None), "payload", None)
            if got is None:
                continue
            buf = got[1].buf   # shared by every op of that broadcast
            for i, rid in enumerate(by_step[e.step].req_ids):
                if rid in gone:
                    buf[i, 0] = 0


def _erase_records(w, gone: set[str]) -> None:
    mon, inner = w.monitor, w.monitor.inner
    for rid in gone:
        for d in (mon.delivered, mon.max_tokens, mon.ignore_eos, inner.admission,
                  inner.sampling_steps, inner.sampled_by_last, inner.received):
            d.pop(rid, None)
        inner.prompt_len[rid] = 0   # only the default of row_admission.get, which hits
        if rid in inner.closed:
            inner.closed[rid] = "closed"
    rows = inner.row_admission
    for key in [k for k in rows if k[1] in gone]:
        rows[key] = (0, rows[key][1], 0)


def _rename(w, outs: list, names: dict[str, str]) -> None:
    get = names.get
    for out in outs:
        if any(r in names for r in out.req_ids):
            object.__setattr__(out, "req_ids", tuple(get(r, r) for r in out.req_ids))
        for f in out.freed:
            if f.req_id in names:
                object.__setattr__(f, "req_id", names[f.req_id])
    for f in w.sched.queues.freed:
        if f.req_id in names:
            object.__setattr__(f, "req_id", names[f.req_id])
    for rk in w.ranks:
        rk.slot_tokens.owner = [None if r is None else get(r, r) for r in rk.slot_tokens.owner]
    inner = w.monitor.inner
    inner.closed = dict(sorted((get(r, r), v) for r, v in inner.closed.items()))
    inner.prompt_len = dict(sorted((get(r, r), v) for r, v in inner.prompt_len.items()))
    inner.row_admission = dict(sorted(((s, get(r, r)), v)
                                      for (s, r), v in inner.row_admission.items()))


def settle_leftovers(w) -> None:
    """Erase the settled leftovers of ``w`` (module docstring); call after the step shift and
    :func:`empty_run_steps` (a run step no longer names its admissions and frees)."""
    outs = sorted(_outputs(w), key=lambda o: o.step)
    gone = set(settled(w, outs))
    if gone:
        _erase_rows(w, {o.step: o for o in outs}, gone)
        _erase_records(w, gone)


def name_leftovers(w) -> None:
    """Rename the settled leftovers ``z0, z1, ...`` in first-seen order (after the slots got
    their canonical labels: the ranks' owners are read in slot order)."""
    outs = sorted(_outputs(w), key=lambda o: o.step)
    gone = settled(w, outs)
    if gone:
        _rename(w, outs, {rid: f"z{i}" for i, rid in enumerate(gone)})


def clear_rank_slot(rk, s: int, fields) -> None:
    """Zero rank ``rk``'s per-request values of slot ``s`` (token history, output cap, seed, last
    prompt token, EOS flags) and ``fields`` of its CPU mirror and device counters."""
    st = rk.slot_tokens
    st.history[s] = []
    rk.output_cap[s] = st.sample_seed[s] = st.last_prompt[s] = 0
    rk.ignore_eos[s] = rk.stopped[s] = False
    rk.grammar_pos[s] = 0
    for f in fields:
        rk.mirror.array(f)[s] = rk.device[f][s] = 0
