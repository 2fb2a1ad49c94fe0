"""The order of one rank's step, driven on a :class:`~ppstate.check.rank.CheckRank`.

Same order as ``runtime/worker/runner.py`` (``StageRunner.step``; docs/design.md §5): consume the
deferred entry -> free / admit -> inputs -> receive -> forward -> send -> last rank: sample, apply,
broadcast (or skip); other ranks: post the deferred receive (sync: blocking broadcast, immediate
apply) -> immediate post-update -> validate the mirrors. Events are emitted as the runner emits
them (``docs/trace_format.md``), so a counterexample replays with ``python -m ppstate.replay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput, StepResult
from ppstate.check.rank import CheckRank, OpHandle
from ppstate.pp_handler import need_sampled_mask

if TYPE_CHECKING:
    from ppstate.check.world import World


def run_step(rk: CheckRank, out: SchedulerOutput, w: "World") -> StepResult | None:
    """Run step ``out`` on rank ``rk``; the last rank returns its StepResult.

    Raises:
        Blocked: a wait cannot complete yet (the caller re-runs the step later).
    """
    sink, r, s = rk.sink, rk.rank, out.step
    sink.emit("rank.step", step=s, rank=r, num_rows=out.num_rows)
    if rk.handler is not None:
        entry = rk.handler.consume()          # waits on the pending receive, if any
        if entry is not None:
            rk.apply_payload(entry.handle.op.payload, entry.idx_mapping)
    rk.apply_freed_new(out)
    mask = need_sampled_mask(out)
    result = None
    if out.is_empty:
        if rk.handler is not None:
            rk.handler.enqueue(s, out, None, None)
        if rk.pp_size > 1:
            sink.emit("broadcast.skipped", step=s, rank=r)
        if rk.is_last:
            result = rk.result(out, np.zeros((0, 1), np.int64), np.zeros(0, np.int64),
                               np.zeros(0, np.int64))
    else:
        w.monitor.check_inputs(rk, out)
        hidden = rk.input_tokens(out) if rk.is_first else rk.recv_prev(s)
        if not rk.is_last:
            rk.send_next(s, hidden)
        rk.apply_scheduled(out)
        if rk.is_last:
            result = _sample_and_publish(rk, out, mask, hidden, w)
        else:
            _post_receive(rk, out, mask)
    rk.validate(s, check_blocks=w.spec_tokens == 0)
    return result


def _blocking(rk: CheckRank) -> bool:
    return not rk.overlapped or mutants.active("blocking_all_chunk_broadcast")


def _sample_and_publish(rk: CheckRank, out: SchedulerOutput, mask: np.ndarray | None,
                        inputs: np.ndarray, w: "World") -> StepResult:
    ids, num_sampled, rejected = rk.sample(out, mask, inputs, w.spec_tokens)
    idx = np.where(mask if mask is not None else False, out.slots, -1).astype(np.int64)
    rk.apply_sampled(idx, ids, num_sampled, rejected)
    w.monitor.record_sampled(out, ids[:, 0])
    if mutants.active("rank_local_skip") and mask is not None and all(
            rk.stopped[int(out.slots[i])] or len(rk.history[int(out.slots[i])]) >=
            rk.output_cap[int(out.slots[i])] for i in np.nonzero(mask)[0]):
        mask = None   # mutant: "nobody needs the last token of a finished request"
    if rk.pp_size > 1:
        payload = (out.step, ids, num_sampled, rejected)
        if mask is None and not mutants.active("blocking_all_chunk_broadcast"):
            rk.sink.emit("broadcast.skipped", step=out.step, rank=rk.rank)
        else:
            if _blocking(rk):
                rk.blocking_broadcast(out.step, payload, root=True)
            else:
                rk.post_broadcast(out.step, payload, root=True)
            rk.sink.emit("broadcast.posted", step=out.step, rank=rk.rank,
                         rows=0 if mask is None else int(mask.sum()))
    rk.sink.emit("sampled", step=out.step, rank=rk.rank, req_ids=list(out.req_ids),
                 token_ids=ids.tolist(), num_sampled=num_sampled.tolist())
    return rk.result(out, ids, num_sampled, rejected)


def _post_receive(rk: CheckRank, out: SchedulerOutput, mask: np.ndarray | None) -> None:
    s, r = out.step, rk.rank
    if mask is None and not mutants.active("blocking_all_chunk_broadcast"):
        if rk.handler is not None:
            rk.handler.enqueue(s, out, None, None)
        rk.sink.emit("broadcast.skipped", step=s, rank=r)
        return
    if _blocking(rk):   # sync mode: blocking broadcast on the pp group, immediate consume
        if rk.handler is not None:   # the mutant keeps the FIFO turning, with empty entries
            rk.handler.enqueue(s, out, None, None)
        payload = rk.blocking_broadcast(s, None, root=False)
        rk.sink.emit("broadcast.posted", step=s, rank=r, rows=0 if mask is None else int(mask.sum()))
        if mask is not None:
            rk.apply_payload(payload, np.where(mask, out.slots, -1).astype(np.int64))
        return
    op = rk.post_broadcast(s, None, root=False)
    rk.handler.enqueue(s, out, mask, OpHandle(rk, op))
    rk.sink.emit("broadcast.posted", step=s, rank=r, rows=int(mask.sum()))
