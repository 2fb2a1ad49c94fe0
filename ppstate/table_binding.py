"""How a state table (``specs/*.yaml``, :mod:`ppstate.state_tables`) drives its code: one way.

* :func:`to_machine` is the one converter from a :class:`~ppstate.state_tables.MachineTable` to
  a ``transitions.Machine`` (no auto transitions, invalid triggers raise; ``=`` stays in the
  source state). The request lifecycle fires its edges through it; the block, slot and
  PPHandler tables build it too, as their validated edge table.
* :func:`check_guards` and :func:`bind_effects` check, when the code that implements a table is
  built (its *load*), that every guard and every effect the table names is a method of the class
  that implements it; :func:`bind_effects` returns the effects per trigger, which that code runs
  after the edge. A name without a method is a
  :class:`~ppstate.errors.TableError` naming the table file, the transition and the class:
  a table and its code cannot drift apart silently.
"""

from __future__ import annotations

from transitions import Machine

from ppstate.errors import TableError
from ppstate.state_tables import SAME, MachineTable


def to_machine(table: MachineTable) -> Machine:
    """The ``transitions`` machine of ``table`` (``model=None``: models are added by the caller).
    Guards become the edges' ``conditions`` (methods of the model, by name); effects are not
    ``transitions`` callbacks: the implementing class runs them (:func:`bind_effects`)."""
    return Machine(
        model=None, states=table.state_names, initial=table.initial,
        transitions=[{"trigger": t.trigger, "source": list(t.source),
                      "dest": None if t.dest == SAME else t.dest, "conditions": list(t.guards)}
                     for t in table.transitions],
        auto_transitions=False, send_event=False, ignore_invalid_triggers=False)


def _missing(table: MachineTable, part: str, cls: type) -> TableError | None:
    for i, t in enumerate(table.transitions):
        for name in getattr(t, part):
            if not callable(getattr(cls, name, None)):
                return TableError(
                    f"{table.file}: transitions[{i}].{part}: {name!r} (trigger {t.trigger!r}) is "
                    f"not a method of {cls.__module__}.{cls.__qualname__}")
    return None


def check_guards(table: MachineTable, cls: type) -> None:
    """Every guard of ``table`` is a method of ``cls`` (the machine's model, or the class that
    evaluates the guard for it).

    Raises:
        TableError: a guard that is not a method of ``cls`` (names the file, row and class).
    """
    if (err := _missing(table, "guards", cls)) is not None:
        raise err


def bind_effects(table: MachineTable, cls: type) -> dict[str, tuple[str, ...]]:
    """Check that every effect of ``table`` is a method of ``cls`` (each called with the
    transition's subject) and return trigger -> its effect method names, for the triggers that
    have any (every row of one trigger must name the same effects).

    Raises:
        TableError: an effect that is not a method of ``cls``, or one trigger with different
            effects on two rows.
    """
    if (err := _missing(table, "effects", cls)) is not None:
        raise err
    out: dict[str, tuple[str, ...]] = {}
    for t in table.transitions:
        if t.effects and out.setdefault(t.trigger, tuple(t.effects)) != tuple(t.effects):
            raise TableError(f"{table.file}: trigger {t.trigger!r} has different effects "
                             f"on two rows")
    return out
