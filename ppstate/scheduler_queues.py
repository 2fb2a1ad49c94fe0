"""The request queues of the scheduler: :class:`RequestQueues`, an object the scheduler owns.

FCFS waiting queue, running requests in admission order, the live requests by id, the recently
finished ones, the slots freed since the last step; admission into a slot (with the prefix-cache
hit blocks), preemption by recompute (vLLM V1's policy: the youngest running request goes back to
the head of the waiting queue, its received tokens kept) and the finishing of a request. The row
builder (:class:`~ppstate.scheduler_rows.RowBuilder`) and the result handler
(:class:`~ppstate.scheduler_results.StepResults`) receive this object as a field.

The effects of the lifecycle's edges (``specs/request.yaml``: ``free_blocks``, ``free_slot``) are
methods of this class, bound when it is built (a name without a method is a
:class:`~ppstate.errors.TableError` then) and run by :meth:`RequestQueues.edge` right after the
edge fires: the table, not a hand-written copy of it, says which edges free what.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from ppstate.batch import FreedSlot, NewRequest
from ppstate.budget import RequestArrays
from ppstate.kv_manager import KVManager
from ppstate.lifecycle import Lifecycle
from ppstate.request import Request
from ppstate.slot_views import SlotViews
from ppstate.slots import SlotTable
from ppstate.table_binding import bind_effects

FINISHED_HISTORY = 1024


class RequestQueues:
    """Waiting, running, live and finished requests, and the slot operations on them.

    Args:
        arrays: per-slot progress (``[max_num_seqs]`` each), reset on admission.
        slots: the slot table.
        kv: the KV-cache manager (blocks taken on admission, freed on preempt / finish).
        views: the slot-indexed views (occupied on admission, vacated on preempt / finish).
        lifecycle: the request lifecycle (a finished request leaves it; its table's effects are
            bound to methods of this class).
        fire: the scheduler's ``fire``: a lifecycle edge, recorded in its event sink.

    Attributes:
        waiting: FCFS queue of requests without a slot.
        running: requests holding a slot, in admission order, by id.
        live: waiting + running, by id.
        finished: id -> final state of the ``FINISHED_HISTORY`` most recent finished requests
            (for ``Scheduler.state_of`` only; a long-running server must not keep every id).
        freed: slots freed since the last issued step (delivered with the next output).
        admissions: admissions so far (all requests): each admission's unique epoch.
        num_preemptions: preemptions so far.
    """

    def __init__(self, arrays: RequestArrays, slots: SlotTable, kv: KVManager, views: SlotViews,
                 lifecycle: Lifecycle, fire: Callable[[Request, str], None]) -> None:
        self.arrays, self.slots, self.kv, self.views = arrays, slots, kv, views
        self.lifecycle, self.fire = lifecycle, fire
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.live: dict[str, Request] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()
        self.freed: list[FreedSlot] = []
        self.admissions = 0
        self.num_preemptions = 0
        self.effects = bind_effects(lifecycle.table, RequestQueues)   # trigger -> method names

    def edge(self, req: Request, trigger: str) -> None:
        """Fire ``trigger`` on ``req`` and run the table's effects of that edge."""
        self.fire(req, trigger)
        for name in self.effects.get(trigger, ()):
            getattr(self, name)(req)

    def free_blocks(self, req: Request) -> None:
        """Effect: ``req``'s KV blocks go back to the pool (nothing when it holds no slot)."""
        if req.slot >= 0:
            self.kv.free(req)

    def free_slot(self, req: Request) -> None:
        """Effect: ``req``'s slot is released (its generation bumped) and reported in the next
        output as a FreedSlot (reason ``preempted``, or the final state); ``req`` leaves the
        running requests. Nothing when it holds no slot."""
        if req.slot >= 0:
            slot = self.slots.free(req.req_id)
            reason = "preempted" if req.state == "waiting" else req.state
            self.freed.append(FreedSlot(req.req_id, slot, reason))
            del self.running[req.req_id]

    def running_requests(self) -> list[Request]:
        """Live requests holding a slot, in admission order."""
        return list(self.running.values())

    def pop_waiting(self) -> Request | None:
        """Oldest waiting request (FCFS), or None."""
        return self.waiting.popleft() if self.waiting else None

    def peek_waiting(self) -> Request | None:
        """Oldest waiting request without removing it."""
        return self.waiting[0] if self.waiting else None

    def fork_waits(self, req: Request) -> bool:
        """Whether ``req`` (a fork, ``spec.fork_of`` set) must wait before its first admission:
        its parent holds a slot and has prefill tokens not yet scheduled. Once they are, the
        parent's full prompt blocks are registered in the prefix cache and ``req`` shares them.
        A fork admitted before (then preempted), or whose parent is waiting or gone, never
        waits: the parent is then never behind it in the FCFS queue, so no wait cycle exists."""
        parent_id = req.spec.fork_of
        if parent_id is None or req.epoch:
            return False
        parent = self.running.get(parent_id)
        return parent is not None and not parent.prefill_fully_scheduled()

    def youngest_running(self, exclude: set[str]) -> Request | None:
        """The most recently admitted running request not in ``exclude`` (preemption victim)."""
        for req in reversed(self.running.values()):
            if req.req_id not in exclude:
                return req
        return None

    def preempt(self, req: Request) -> None:
        """Preempt ``req`` (recompute): blocks and slot freed (FreedSlot in this step's output,
        so workers bump the slot generation and drop its deferred rows), back to the head of
        the waiting queue with its received tokens kept."""
        self.views.vacate(req.slot, self.arrays)
        self.edge(req, "preempt")   # effects: free_blocks, free_slot
        req.slot = -1
        req.prefill_tokens = req.spec.prompt_token_ids + tuple(req.output_token_ids)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def place(self, req: Request, step: int, hit: list[int]) -> NewRequest:
        """Allocate a slot for ``req``, fire ``admit``, give it its prefix-hit blocks ``hit`` and
        initialise its progress arrays (re-admission: prompt + received tokens are prefilled)."""
        req.slot = self.slots.allocate(req.req_id)
        self.admissions += 1
        req.epoch = self.admissions  # unique: stale rows of an earlier request with this id never match
        self.fire(req, "admit")
        cached = self.kv.start(req, hit)
        n_out = len(req.output_token_ids)
        self.arrays.reset(req.slot, len(req.prefill_tokens), req.max_tokens, step, cached, n_out)
        self.running[req.req_id] = req
        self.views.occupy(req, n_out)
        return NewRequest(req.req_id, req.slot, req.prefill_tokens,
                          req.prompt_len + req.max_tokens, dict(req.spec.sampling), cached, n_out)

    def finish(self, req: Request, trigger: str) -> None:
        """Fire ``trigger`` (a finishing edge) on ``req``; its effects free its slot and blocks
        when it holds one (FreedSlot in the next output); remember its final state."""
        if req.slot >= 0:
            self.views.vacate(req.slot, self.arrays)
        self.edge(req, trigger)   # effects: free_blocks, free_slot
        self.finished[req.req_id] = req.state
        self.finished.move_to_end(req.req_id)
        while len(self.finished) > FINISHED_HISTORY:
            self.finished.popitem(last=False)
        del self.live[req.req_id]
        self.lifecycle.remove(req)
