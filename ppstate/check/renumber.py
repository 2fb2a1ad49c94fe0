"""Renaming rules of the canonical state (:mod:`ppstate.check.canon`): step numbers, op match
indices, slot generations and KV block ids are names or counters whose absolute values no
decision reads; only their equalities, order and differences matter. docs/checker.md argues each
rule; in short:

* **Steps** are shifted so that the next step is 0: every reader compares steps with each other
  (a FIFO's order, ``<=`` against the step being built, differences for the cadence, bisection
  in the monitor's sampling history) and a common shift keeps every outcome. The one reader of a
  step's residue, adaptive lanes (``lane_open``: step mod pp_size; ``--adaptive-lanes``), keeps
  its value: with them on, the shift is a multiple of pp_size and the next step below pp_size.
  A live slot's
  ``next_eligible_step`` values older than the next step are compressed in order (``-1, -2``..):
  every future step passes ``<=`` for all of them and only their order (the ``argsort`` of
  ``add_decodes``) is read.
* **Op match indices** are shifted per p2p link (by the smaller of the send and receive counts)
  and per collective group (by the smallest per-rank count): ops are matched by equal indices
  (p2p) or by queue position (collectives).
* **Slot generations**: a PPHandler compares an entry's recorded generation with the slot's
  current one for equality only, and generations only grow: current -> 0, older -> -1. The
  scheduler's own ``SlotTable.generation`` is read by no checker path (the replayer reads it) and
  is set to 0.
* **Block ids** are names: the code compares them only for equality and set membership. Blocks
  are renamed in the order (tables by request id, cached in LRU order, free in free-list order),
  which makes the free list ``[k, k + 1, ...]``. When no cached block can be hit again (its hash is
  in no live request's chain: prompts of different requests share no first token, so only a
  preempted request can hit, and only its own blocks), cached blocks are turned free: they are
  then interchangeable with free ones (both are taken only after every free one, as names).
  Issued steps' ``block_table_ids`` are read by no rank of the checker and are set to 0.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque

import numpy as np

from ppstate.block_states import CACHED, FREE


# ------------------------------------------------------------------------------ steps
def _outputs(w) -> list:
    seen = {id(o): o for o in w.outputs.values()}
    seen.update({id(o): o for o in w.sched.results.in_flight})
    return list(seen.values())


def ops_of(w) -> list:
    """Every op the world still references (comm queues, rank logs, handler entries)."""
    found = {}
    for q in w.comm.queues.values():
        found.update({id(o): o for o in q})
    for rk in w.ranks:
        found.update({id(o): o for o in rk.oplog})
        if rk.blocked_on is not None:
            found[id(rk.blocked_on)] = rk.blocked_on
        if rk.handler is not None:
            for e in rk.handler._fifo:
                op = getattr(getattr(e, "handle", None), "op", None)
                if op is not None:
                    found[id(op)] = op
    return list(found.values())


def shift_steps(w, ops: list) -> None:
    """Shift every step number of ``w`` by ``-sched.next_step`` (module docstring)."""
    base = w.sched._next_step
    if w.sched.config.adaptive_lanes:   # lane_open reads step mod pp_size: keep it
        base -= base % w.pp_size
    # also with base 0 (adaptive lanes: the next step below pp_size): the rebuilt admission
    # tuples below must not share objects the way unshifted ones do, or equal states pickle apart
    w.sched._next_step -= base   # 0, or below pp_size with adaptive lanes
    for out in _outputs(w):
        object.__setattr__(out, "step", out.step - base)
    w.outputs = {o.step: o for o in sorted(w.outputs.values(), key=lambda o: o.step)}
    for res in w.results:
        object.__setattr__(res, "step", res.step - base)
    for rk in w.ranks:
        rk.next_step -= base
        if rk.handler is not None:
            for e in rk.handler._fifo:
                if e is not None:
                    object.__setattr__(e, "step", e.step - base)
    for op in ops:
        op.step -= base
        if op.kind == "bcast" and isinstance(op.payload, tuple):
            op.payload = (op.payload[0] - base, op.payload[1])
    inner = w.monitor.inner
    inner.admission = {r: (a - base, p, k) for r, (a, p, k) in inner.admission.items()}
    inner.row_admission = {(s - base, r): (a - base, p, k)
                           for (s, r), (a, p, k) in inner.row_admission.items()}
    for steps in inner.sampling_steps.values():
        steps[:] = [s - base for s in steps]
    posts = inner._posts
    for s in sorted(posts):
        posts[s - base] = posts.pop(s)
    live = [r.slot for r in w.sched.queues.running.values()]
    w.sched.arrays.next_eligible_step[live] -= base
    _compress_eligible(w)


def _compress_eligible(w) -> None:
    a = w.sched.arrays
    live = np.array(sorted(r.slot for r in w.sched.queues.running.values()), dtype=np.int64)
    vals = a.next_eligible_step[live]
    old = sorted({int(v) for v in vals if v < 0}, reverse=True)
    rank = {v: -(i + 1) for i, v in enumerate(old)}
    for j, v in zip(live.tolist(), vals.tolist()):
        if v < 0:
            a.next_eligible_step[j] = rank[v]


def trim_sampling_history(w) -> None:
    """Sampling steps before the oldest admission a row can still be judged against are read
    only through ``bisect`` counts that start at an admission step: dropped."""
    inner = w.monitor.inner
    low: dict[str, int] = {}
    for rid, (a, _, _) in inner.admission.items():
        low[rid] = a
    for (_, rid), (a, _, _) in inner.row_admission.items():
        low[rid] = min(low.get(rid, a), a)
    for rid, steps in inner.sampling_steps.items():
        if rid in low:
            steps[:] = [s for s in steps if s >= low[rid]]
    _clamp_old_steps(w)


def _clamp_old_steps(w) -> None:
    """Sampling and admission steps older than ``L - cadence`` (``L``: the oldest step a rank
    still runs; every future check runs at a step >= L) are set to ``L - cadence - 1``, for
    requests with one admission in the records: the cadence check then passes for them as before
    (``s - v > cadence``), and the bisection counts from the admission step are unchanged (every
    sampling step is >= the admission, and clamped values keep that order)."""
    inner = w.monitor.inner
    old = min(rk.next_step for rk in w.ranks) - inner.cadence
    clamp = old - 1
    adm: dict[str, set[int]] = {}
    for rid, (a, _, _) in inner.admission.items():
        adm.setdefault(rid, set()).add(a)
    for (_, rid), (a, _, _) in inner.row_admission.items():
        adm.setdefault(rid, set()).add(a)
    single = {rid for rid, v in adm.items() if len(v) == 1}
    for rid in single:
        steps = inner.sampling_steps.get(rid)
        if steps:
            steps[:] = [clamp if s < old else s for s in steps]
        a, p, k = inner.admission.get(rid, (None, 0, 0))
        if a is not None and a < old:
            inner.admission[rid] = (clamp, p, k)
    rows = inner.row_admission
    for key, (a, p, k) in list(rows.items()):
        if key[1] in single and a < old:
            rows[key] = (clamp, p, k)


# ------------------------------------------------------------------------------ comm
def shift_comm(w, ops: list) -> None:
    """Shift op match indices per p2p link and per collective group (module docstring)."""
    comm = w.comm
    links = {(g, s, d) for (g, s, d, _) in comm.p2p_count}
    for g, s, d in sorted(links):
        ks, kr = (g, s, d, "send"), (g, s, d, "recv")
        base = min(comm.p2p_count.get(ks, 0), comm.p2p_count.get(kr, 0))
        if base:
            for k in (ks, kr):
                if k in comm.p2p_count:
                    comm.p2p_count[k] -= base
            for op in ops:
                if op.kind != "bcast" and op.group == g and \
                        (op.rank, op.peer) == ((s, d) if op.kind == "send" else (d, s)):
                    op.index -= base
    groups = {g for (g, _) in comm.coll_count}
    for g in sorted(groups):
        keys = [(g, r) for r in range(w.pp_size)]
        base = min(comm.coll_count.get(k, 0) for k in keys)
        if base:
            for k in keys:
                comm.coll_count[k] -= base
            for op in ops:
                if op.kind == "bcast" and op.group == g:
                    op.index -= base
    # group and kind names: the literals' (interned) string objects, as in ops issued by the code
    # (a pickle memoizes strings by identity: a restored copy would pickle differently)
    intern = sys.intern
    for op in ops:
        op.group, op.kind = intern(op.group), intern(op.kind)
    comm.queues = {(intern(g), r): q for (g, r), q in comm.queues.items()}
    comm.p2p_count = {(intern(g), s, d, intern(k)): n
                      for (g, s, d, k), n in sorted(comm.p2p_count.items())}
    comm.coll_count = {(intern(g), r): n for (g, r), n in sorted(comm.coll_count.items())}


# ------------------------------------------------------------------------------ generations
def renumber_generations(w) -> None:
    """Slot generations: current -> 0, older -> -1 per PPHandler; the scheduler's to 0."""
    w.sched.slots.generation[:] = 0
    for rk in w.ranks:
        h = rk.handler
        if h is None:
            continue
        cur = h.generation
        for e in h._fifo:
            if e is not None:
                fresh = e.generations == cur[e.idx_mapping]
                object.__setattr__(e, "generations", np.where(fresh, 0, -1).astype(np.int64))
        cur[:] = 0


# ------------------------------------------------------------------------------ blocks
def _hittable(w, pool) -> set[int]:
    hashes = set()
    for req in w.sched.queues.live.values():
        hashes.update(req.block_hashes)
    return {b for b in pool._lru if pool.block_hash[b] in hashes}


def rename_blocks(w) -> None:
    """Rename KV block ids canonically; free unhittable cached blocks (module docstring)."""
    pool = w.sched.kv.pool
    if pool._lru and not _hittable(w, pool):
        for b in list(pool._lru):
            del pool._by_hash[pool.block_hash.pop(b)]
            pool.block_tokens.pop(b, None)
            pool.states.code[b] = FREE
            pool._free.append(b)
        pool._lru.clear()
    order: list[int] = []
    for rid in sorted(pool.tables):
        order += [b for b in pool.tables[rid] if b not in order]
    order += [b for b in pool._lru if b not in order]
    order += list(pool._free)
    new = {b: i for i, b in enumerate(order)}
    perm = np.array(order, dtype=np.int64)           # new id -> old id
    pool.states.code = pool.states.code[perm].copy()
    pool.ref_count = pool.ref_count[perm].copy()
    pool.block_hash = {new[b]: h for b, h in sorted(pool.block_hash.items(), key=lambda x: new[x[0]])}
    pool.block_tokens = {new[b]: t for b, t in sorted(pool.block_tokens.items(),
                                                        key=lambda x: new[x[0]])}
    pool._by_hash = {h: new[b] for h, b in sorted(pool._by_hash.items(), key=lambda x: new[x[1]])}
    pool._free = deque(new[b] for b in pool._free)
    pool._lru = OrderedDict((new[b], None) for b in pool._lru)
    pool.tables = {rid: [new[b] for b in pool.tables[rid]] for rid in sorted(pool.tables)}
    assert int(np.count_nonzero(pool.states.code == CACHED)) == len(pool._lru)
    for out in _outputs(w):
        if out.block_table_ids.size:
            object.__setattr__(out, "block_table_ids", np.zeros_like(out.block_table_ids))
