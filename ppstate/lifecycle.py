"""Request lifecycle machine built from ``specs/request.yaml``.

One shared ``transitions.Machine(model=None, auto_transitions=False)`` per :class:`Lifecycle`
(built by :func:`ppstate.table_binding.to_machine`); each live request is added as a model and
removed when it reaches a final state. The machine is the only writer of ``model.state``.
Triggers fire on lifecycle edges only, never per token. The table's guards are methods of the
request model, checked when the lifecycle is built; its effects are methods of the request
queues (:class:`~ppstate.scheduler_queues.RequestQueues`), which bind and run them.
"""

from __future__ import annotations

from typing import Protocol

from transitions import MachineError

from ppstate.errors import IllegalTransition
from ppstate.request import Request
from ppstate.state_tables import MachineTable, load_table
from ppstate.table_binding import check_guards, to_machine


class LifecycleModel(Protocol):
    """What a request model must provide: ``req_id`` and the guard methods named in the spec."""
    req_id: str
    state: str


class Lifecycle:
    """Owns the shared request machine and the set of requests added to it.

    Args:
        table: the machine table; defaults to ``specs/request.yaml``.
        model_type: the class of the models, whose methods the table's guards name.

    Raises:
        TableError: a guard of the table is not a method of ``model_type``.
    """

    def __init__(self, table: MachineTable | None = None, model_type: type = Request) -> None:
        self.table = table or load_table("request")
        self.final_states = frozenset(self.table.final_states)
        self._triggers = {t.trigger for t in self.table.transitions}
        check_guards(self.table, model_type)
        self.machine = to_machine(self.table)

    def add(self, request: LifecycleModel) -> None:
        """Attach ``request`` to the machine in the initial state (``waiting``)."""
        self.machine.add_model(request, initial=self.table.initial)

    def remove(self, request: LifecycleModel) -> None:
        """Detach ``request`` (after it reached a final state)."""
        self.machine.remove_model(request)

    def fire(self, request: LifecycleModel, trigger: str) -> str:
        """Fire ``trigger`` on ``request`` and return its new state.

        Raises:
            IllegalTransition: no edge for (trigger, current state), or a guard returned False;
                names the request id, its state and the trigger.
        """
        if trigger not in self._triggers:
            raise IllegalTransition(request.req_id, request.state, trigger, "unknown trigger")
        before = request.state
        try:
            ok = request.trigger(trigger)
        except MachineError:
            raise IllegalTransition(request.req_id, before, trigger) from None
        if not ok:
            raise IllegalTransition(request.req_id, before, trigger, "guard returned False")
        return request.state

    def is_final(self, state: str) -> bool:
        """True for finished_* states."""
        return state in self.final_states
