"""The two state tables whose machine only validates the edges, checked against their code.

``specs/request.yaml`` and ``specs/block.yaml`` are built into ``transitions`` machines
(:mod:`ppstate.lifecycle`, :mod:`ppstate.block_states`), so code and table cannot differ. The slot
(``specs/slot.yaml``) and the PPHandler entry (``specs/pp_handler.yaml``) are hand-written
numpy / deque code (:class:`ppstate.slots.SlotTable`, :class:`ppstate.pp_handler.PPHandler`; their
guards and effects are bound to methods, :mod:`ppstate.table_binding`): the tables specify them,
and these tests run the code from every non-final state through every trigger (each guard true
and false) and compare the observed relation — the state reached, the effects seen, or a
refusal — with the table's. A changed edge, source, destination, guard or
effect on either side fails here; so does a trigger with no operation in the code.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from ppstate.batch import SchedulerOutput
from ppstate.errors import PPStateError, SlotError
from ppstate.pp_handler import PPHandler
from ppstate.slots import SlotTable
from ppstate.state_tables import SPECS_DIR, MachineTable, load_table, parse_table

Relation = dict[tuple[str, str, bool], tuple[str, frozenset[str]] | None]


def table_relation(spec: MachineTable, guard_values: dict[str, tuple[bool, ...]]) -> Relation:
    """(trigger, source, guards hold) -> (destination, effects), or None where the table has no
    edge (the code must refuse). A guarded edge whose guard fails leaves the state as it is and
    has no effect. ``guard_values[trigger]``: the guard outcomes the code can be driven with."""
    edges = {(t.trigger, src): t for t in spec.transitions for src in t.source}
    rel: Relation = {}
    for trigger in {t.trigger for t in spec.transitions}:
        for source in spec.state_names:
            if source in spec.final_states:
                continue
            for ok in guard_values.get(trigger, (True,)):
                t = edges.get((trigger, source))
                if t is None:
                    rel[(trigger, source, ok)] = None
                elif ok or not t.guards:
                    dest = source if t.dest == "=" else t.dest
                    rel[(trigger, source, ok)] = (dest, frozenset(t.effects))
                else:
                    rel[(trigger, source, ok)] = (source, frozenset())
    return rel


# ---- slot -----------------------------------------------------------------------------------
def _slot_state(table: SlotTable) -> str:
    return "free" if table.owner[0] is None else "allocated"


SLOT_OPS: dict[str, Callable[[SlotTable], object]] = {
    "allocate": lambda t: t.allocate("other"),
    "release": lambda t: t.free("r"),
}


def slot_relation(spec: MachineTable) -> Relation:
    """The relation :class:`SlotTable` shows on its one slot, driven by ``SLOT_OPS``."""
    rel: Relation = {}
    for trigger, op in SLOT_OPS.items():
        for source in spec.state_names:
            table = SlotTable(1)
            if source == "allocated":
                table.allocate("r")
            assert _slot_state(table) == source
            gen = int(table.generation[0])
            try:
                op(table)
            except SlotError:
                rel[(trigger, source, True)] = None
                continue
            bumped = int(table.generation[0]) - gen
            assert bumped in (0, 1)
            rel[(trigger, source, True)] = (_slot_state(table),
                                            frozenset({"bump_generation"} if bumped else ()))
    return rel


# ---- PPHandler entry (depth 1: one entry in the FIFO at a time) -----------------------------
OUT = SchedulerOutput(0, ("a", "b"), np.array([0, 1], dtype=np.int32),
                      np.ones(2, dtype=np.int32), np.zeros(2, dtype=np.int32),
                      np.array([True, False]), (), ())
MASK = np.array([True, False])


def _handler_with_entry(source: str, trigger: str) -> PPHandler:
    """A handler whose entry under test is in ``source``. Consume pops the initial entry and makes
    room for the next step's, which is empty until enqueue fills it (the entry ``enqueue`` acts
    on); for the other triggers that entry is pushed (empty, or pending with ``MASK``)."""
    h = PPHandler(depth=1, max_num_reqs=2)
    h.consume()
    if source == "pending":
        h.enqueue(0, OUT, MASK)
    elif trigger != "enqueue":
        h.enqueue(0, OUT, None)
    return h


def _entry_state(h: PPHandler, step: int) -> str:
    if len(h) == 0:
        return "consumed"
    return "pending" if step in h.pending_steps() else "empty"


PP_OPS: dict[str, Callable[[PPHandler, bool], tuple[object, int]]] = {
    # operation, and the step whose entry it acts on
    "enqueue": lambda h, ok: (h.enqueue(1, OUT, MASK if ok else None), 1),
    "consume": lambda h, ok: (h.consume(), 0),
    "free": lambda h, ok: (h.on_slot_freed(0), 0),
}
PP_GUARDS = {"enqueue": (True, False)}   # mask_nonempty: a need-sampled mask, or None


def pp_handler_relation(spec: MachineTable) -> Relation:
    rel: Relation = {}
    for trigger, op in PP_OPS.items():
        for source in spec.state_names:
            if source in spec.final_states:
                continue
            for ok in PP_GUARDS.get(trigger, (True,)):
                h = _handler_with_entry(source, trigger)
                gen = h.generation.copy()
                try:
                    _, step = op(h, ok)
                except PPStateError:
                    rel[(trigger, source, ok)] = None
                    continue
                bumped = bool((h.generation != gen).any())
                rel[(trigger, source, ok)] = (_entry_state(h, step),
                                              frozenset({"bump_generation"} if bumped else ()))
    return rel


# ---- the checks -----------------------------------------------------------------------------
def test_slot_table_implements_specs_slot_yaml():
    spec = load_table("slot")
    assert {t.trigger for t in spec.transitions} == set(SLOT_OPS)
    assert spec.initial == _slot_state(SlotTable(1))
    assert slot_relation(spec) == table_relation(spec, {})


def test_pp_handler_implements_specs_pp_handler_yaml():
    spec = load_table("pp_handler")
    assert {t.trigger for t in spec.transitions} == set(PP_OPS)
    assert {g for t in spec.transitions for g in t.guards} == {"mask_nonempty"}
    assert _entry_state(PPHandler(1, 2), -1) == spec.initial    # the FIFO starts with empty entries
    assert all(src not in spec.final_states for t in spec.transitions for src in t.source)
    assert pp_handler_relation(spec) == table_relation(spec, PP_GUARDS)


@pytest.mark.parametrize("name, edit", [
    ("slot", ("    effects: [bump_generation]\n", "")),                    # effect dropped
    ("slot", ("  - trigger: allocate\n    source: free\n",
              "  - trigger: allocate\n    source: [free, allocated]\n")),  # extra source
    ("pp_handler", ("    guards: [mask_nonempty]\n", "")),                 # guard dropped
    ("pp_handler", ("    source: [empty, pending]\n    dest: consumed\n",
                    "    source: [pending]\n    dest: consumed\n")),       # edge dropped
])
def test_a_table_that_differs_from_its_code_is_caught(name, edit):
    text = (SPECS_DIR / f"{name}.yaml").read_text()
    assert edit[0] in text
    spec = parse_table(text.replace(edit[0], edit[1], 1), file=f"{name}.yaml")
    observed = slot_relation(spec) if name == "slot" else pp_handler_relation(spec)
    assert observed != table_relation(spec, PP_GUARDS if name == "pp_handler" else {})
