"""Each state table drives its code one way (ppstate.table_binding): guards and effects are
methods of the class that implements the table, checked when that code is built; the request
table's effects run through RequestQueues.edge."""

from __future__ import annotations

import pytest

from ppstate.budget import SchedulerConfig
from ppstate.errors import TableError
from ppstate.lifecycle import Lifecycle
from ppstate.request import RequestSpec
from ppstate.scheduler import Scheduler
from ppstate.state_tables import load_table, parse_table
from ppstate.table_binding import bind_effects, check_guards, to_machine

TABLE = """\
name: m
initial: a
states:
  - name: a
  - name: b
transitions:
  - trigger: go
    source: a
    dest: b
    guards: [ready]
    effects: [tidy]
  - trigger: back
    source: b
    dest: a
"""


class Impl:
    def ready(self) -> bool:
        return True

    def tidy(self, subject) -> None:
        pass

    def sweep(self, subject) -> None:
        pass


class NoEffects:
    def ready(self) -> bool:
        return True


def test_bound_table_returns_effects_per_trigger():
    table = parse_table(TABLE, file="m.yaml")
    check_guards(table, Impl)
    assert bind_effects(table, Impl) == {"go": ("tidy",)}


def test_missing_effect_method_is_an_error_naming_file_row_and_class():
    table = parse_table(TABLE, file="m.yaml")
    with pytest.raises(TableError) as info:
        bind_effects(table, NoEffects)
    assert str(info.value) == (
        "m.yaml: transitions[0].effects: 'tidy' (trigger 'go') is not a method of "
        f"{__name__}.NoEffects")


def test_missing_guard_method_is_an_error_when_the_lifecycle_is_built():
    table = parse_table(TABLE, file="m.yaml")
    with pytest.raises(TableError) as info:
        Lifecycle(table, model_type=object)
    assert str(info.value) == ("m.yaml: transitions[0].guards: 'ready' (trigger 'go') is not a "
                               "method of builtins.object")


def test_one_trigger_with_two_effect_lists_is_refused():
    text = TABLE.replace("    dest: a\n", "    dest: a\n    effects: [sweep]\n").replace(
        "trigger: back", "trigger: go")
    table = parse_table(text, file="m.yaml")
    with pytest.raises(TableError, match=r"^m\.yaml: trigger 'go' has different effects"):
        bind_effects(table, Impl)


def test_converter_builds_the_tables_edges():
    machine = to_machine(load_table("slot"))
    assert sorted(machine.events) == ["allocate", "release"]
    assert machine.events["release"].transitions["allocated"][0].dest == "free"


def test_request_effects_free_the_slot_through_the_table():
    sched = Scheduler(SchedulerConfig(pp_size=1, max_num_seqs=1, max_num_batched_tokens=8,
                                      max_prefill_chunk=8, max_model_len=32))
    assert sched.queues.effects == {"preempt": ("free_blocks", "free_slot"),
                                    "stop": ("free_blocks", "free_slot"),
                                    "hit_length": ("free_blocks", "free_slot"),
                                    "abort": ("free_blocks", "free_slot")}
    sched.add_request(RequestSpec("a", (1, 2, 3), max_tokens=4))
    out = sched.schedule()
    assert out.slots.tolist() == [0]
    assert sched.abort("a")
    assert sched.slots.num_free == 1 and sched.kv.pool.tables == {}
    assert [(f.req_id, f.slot, f.reason) for f in sched.queues.freed] == [
        ("a", 0, "finished_aborted")]
