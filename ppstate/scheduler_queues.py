"""The request queues as the row builder sees them: :class:`QueueOps`, a part of
:class:`ppstate.scheduler.Scheduler` (a mixin; it holds no state of its own).

FCFS waiting queue, running requests in admission order, admission into a slot (with the
prefix-cache hit blocks) and preemption by recompute (vLLM V1's policy: the youngest running
request goes back to the head of the waiting queue, its received tokens kept).
"""

from __future__ import annotations

from collections.abc import Callable
from collections import deque

import numpy as np

from ppstate.batch import FreedSlot, NewRequest
from ppstate.budget import RequestArrays
from ppstate.kv_manager import KVManager
from ppstate.request import Request
from ppstate.slots import SlotTable


class QueueOps:
    """Queue and slot operations the :class:`~ppstate.scheduler_rows.RowBuilder` calls (its
    :class:`~ppstate.scheduler_rows.RowSource` protocol).

    Uses the scheduler's state (annotated below; set by ``Scheduler.__init__``) and its
    :meth:`fire`.
    """
    arrays: RequestArrays                        # per-slot progress, [max_num_seqs] each
    slots: SlotTable
    kv: KVManager
    num_preemptions: int
    _waiting: deque[Request]
    _running: dict[str, Request]
    _freed: list[FreedSlot]
    _admissions: int
    slot_epoch: np.ndarray                       # [max_num_reqs] occupant's epoch, 0 = free
    decoding: np.ndarray                         # [max_num_reqs] bool, occupant is decoding
    slot_req: list[Request | None]               # [max_num_reqs] occupant
    out_tokens: np.ndarray                       # [max_num_reqs, max_model_len] occupant's outputs
    fire: Callable[[Request, str], None]         # Scheduler.fire: a lifecycle edge, recorded

    def running_requests(self) -> list[Request]:
        """Live requests holding a slot, in admission order."""
        return list(self._running.values())

    def pop_waiting(self) -> Request | None:
        """Oldest waiting request (FCFS), or None."""
        return self._waiting.popleft() if self._waiting else None

    def peek_waiting(self) -> Request | None:
        """Oldest waiting request without removing it."""
        return self._waiting[0] if self._waiting else None

    def fork_waits(self, req: Request) -> bool:
        """Whether ``req`` (a fork, ``spec.fork_of`` set) must wait before its first admission:
        its parent holds a slot and has prefill tokens not yet scheduled. Once they are, the
        parent's full prompt blocks are registered in the prefix cache and ``req`` shares them.
        A fork admitted before (then preempted), or whose parent is waiting or gone, never
        waits: the parent is then never behind it in the FCFS queue, so no wait cycle exists."""
        parent_id = req.spec.fork_of
        if parent_id is None or req.epoch:
            return False
        parent = self._running.get(parent_id)
        return parent is not None and not parent.prefill_fully_scheduled()

    def youngest_running(self, exclude: set[str]) -> Request | None:
        """The most recently admitted running request not in ``exclude`` (preemption victim)."""
        for req in reversed(self._running.values()):
            if req.req_id not in exclude:
                return req
        return None

    def preempt(self, req: Request) -> None:
        """Preempt ``req`` (recompute): blocks and slot freed (FreedSlot in this step's output,
        so workers bump the slot generation and drop its deferred rows), back to the head of
        the waiting queue with its received tokens kept."""
        self.fire(req, "preempt")
        self.vacate(req.slot)
        self.kv.free(req)
        slot = self.slots.free(req.req_id)
        self._freed.append(FreedSlot(req.req_id, slot, "preempted"))
        del self._running[req.req_id]
        req.slot = -1
        req.prefill_tokens = req.spec.prompt_token_ids + tuple(req.output_token_ids)
        self._waiting.appendleft(req)
        self.num_preemptions += 1

    def vacate(self, slot: int) -> None:
        """Clear the slot-indexed views of ``slot`` (its request finished or was preempted);
        its request's ``output_token_ids`` get the tokens of its ``out_tokens`` row."""
        req, n = self.slot_req[slot], int(self.arrays.num_output_tokens[slot])
        if req is not None and n:
            req.output_token_ids[:] = self.out_tokens[slot, :n].tolist()
            self.out_tokens[slot, :n] = 0
        self.slot_epoch[slot], self.decoding[slot], self.slot_req[slot] = 0, False, None

    def place(self, req: Request, step: int, hit: list[int]) -> NewRequest:
        """Allocate a slot for ``req``, fire ``admit``, give it its prefix-hit blocks ``hit`` and
        initialise its progress arrays (re-admission: prompt + received tokens are prefilled)."""
        req.slot = self.slots.allocate(req.req_id)
        self._admissions += 1
        req.epoch = self._admissions  # unique: stale rows of an earlier request with this id never match
        self.fire(req, "admit")
        cached = self.kv.start(req, hit)
        n_out = len(req.output_token_ids)
        self.arrays.reset(req.slot, len(req.prefill_tokens), req.max_tokens, step, cached, n_out)
        self._running[req.req_id] = req
        self.slot_epoch[req.slot], self.slot_req[req.slot] = req.epoch, req
        if n_out:
            self.out_tokens[req.slot, :n_out] = req.output_token_ids
        return NewRequest(req.req_id, req.slot, req.prefill_tokens,
                          req.prompt_len + req.max_tokens, dict(req.spec.sampling), cached, n_out)
