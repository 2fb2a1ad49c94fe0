"""Slot indices are names: a symmetry of the canonical form (:mod:`ppstate.check.canon`).

The code compares slot indices for equality and uses them as array indices; it never orders
rows, requests or decisions by slot index (decode candidates are ordered by eligibility, then
admission epoch; continuing prefills by epoch; admission takes the free list's order, which
travels with the state). So two worlds that differ by a renaming of slots (applied to every
slot-indexed array and list and to every slot number the world holds) have futures that differ by
the same renaming. :func:`canonical_orders` names the canonical labelings: occupied slots first,
by admission epoch (unique), then free slots in the order the free list hands them out (the order
admissions see). When no slot can be allocated again (every request arrived, none live; the free
list is then sorted and its order unread) the free slots differ only in what the ranks still hold
for settled leftovers, and every order of them is a candidate: the canonical form is the one with
the smallest key (:func:`ppstate.check.canon.canonical`). docs/checker_canon.md.
"""

from __future__ import annotations

from itertools import permutations

import numpy as np

from ppstate.check.renumber import _outputs


def canonical_orders(w) -> list[list[int]]:
    """Candidate labelings, each ``[new slot] -> old slot``."""
    s = w.sched
    n = len(s.slots.owner)
    occupied = sorted((int(s.views.slot_epoch[j]), j) for j in range(n) if s.slots.owner[j] is not None)
    free = list(reversed(s.slots._free))           # the next one handed out first
    head = [j for _, j in occupied]
    if s.queues.live or w.arrived < w.cfg.num_requests or len(free) < 2:
        return [head + free]
    return [head + list(p) for p in permutations(sorted(free))]


def relabel(w, order: list[int]) -> None:
    """Rename slot ``order[k]`` to ``k`` everywhere in ``w``."""
    n = len(order)
    if order == list(range(n)):
        return
    inv = np.array(order, dtype=np.int64)                     # new -> old
    pi = np.empty(n, dtype=np.int64)
    pi[inv] = np.arange(n)                                     # old -> new
    _relabel_scheduler(w, order, inv, pi)
    _relabel_steps(w, pi)
    for rk in w.ranks:
        _relabel_rank(rk, order, inv, pi)


def _relabel_scheduler(w, order: list[int], inv: np.ndarray, pi: np.ndarray) -> None:
    s = w.sched
    t = s.slots
    t.generation = t.generation[inv]
    t.owner = [t.owner[o] for o in order]
    t._free = [int(pi[x]) for x in t._free]
    t._slot_of = {r: int(pi[x]) for r, x in t._slot_of.items()}
    for f in s.arrays.FIELDS:
        setattr(s.arrays, f, getattr(s.arrays, f)[inv])
    s.views.slot_epoch, s.views.decoding = s.views.slot_epoch[inv], s.views.decoding[inv]
    s.views.slot_req = [s.views.slot_req[o] for o in order]
    s.views.out_tokens = s.views.out_tokens[inv]
    for r in s.queues.live.values():
        if r.slot >= 0:
            r.slot = int(pi[r.slot])
    s.kv.held = s.kv.held[inv]
    d = s.kv.digests
    d.table, d.num_blocks, d.values = d.table[inv], d.num_blocks[inv], d.values[inv]
    s.kv._slots = [int(pi[x]) for x in s.kv._slots]


def _relabel_steps(w, pi: np.ndarray) -> None:
    freed = {id(f): f for f in w.sched.queues.freed}
    for out in _outputs(w):
        freed.update((id(f), f) for f in out.freed)
        for nr in out.new_requests:
            object.__setattr__(nr, "slot", int(pi[nr.slot]))
        if out.slots.size:
            object.__setattr__(out, "slots", pi[out.slots].astype(out.slots.dtype))
        if out.block_table_slots.size:
            object.__setattr__(out, "block_table_slots",
                               pi[out.block_table_slots].astype(out.block_table_slots.dtype))
    for f in freed.values():
        object.__setattr__(f, "slot", int(pi[f.slot]))


def _relabel_rank(rk, order: list[int], inv: np.ndarray, pi: np.ndarray) -> None:
    st = rk.slot_tokens
    st.owner = [st.owner[o] for o in order]
    st.history = [st.history[o] for o in order]
    st.sample_seed, st.last_prompt = st.sample_seed[inv], st.last_prompt[inv]
    for name in ("output_cap", "ignore_eos", "stopped", "grammar_pos"):
        setattr(rk, name, getattr(rk, name)[inv])
    rk.mirror.values[:] = rk.mirror.values[:, inv]   # in place: the mirror keeps row views
    rk.device = {f: a[inv] for f, a in rk.device.items()}
    rk.block_table = rk.block_table[inv]
    h = rk.handler
    if h is None:
        return
    h.generation = h.generation[inv]
    for e in h._fifo:
        if e is not None:
            object.__setattr__(e, "idx_mapping", pi[e.idx_mapping])
