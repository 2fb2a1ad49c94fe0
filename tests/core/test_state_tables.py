"""Spec loading: the three real tables load; malformed tables are rejected with the file, the key
path and the line."""

from __future__ import annotations

import pytest

from ppstate.errors import TableError
from ppstate.state_tables import SPECS_DIR, load_table, parse_table

BASE = """\
name: m
initial: a
states:
  - name: a
  - name: b
    final: true
transitions:
  - trigger: go
    source: a
    dest: b
"""


def _error(text: str) -> str:
    with pytest.raises(TableError) as info:
        parse_table(text, file="bad.yaml")
    return str(info.value)


def test_base_table_is_valid():
    spec = parse_table(BASE, file="ok.yaml")
    assert spec.name == "m"
    assert spec.initial == "a"
    assert spec.state_names == ["a", "b"]
    assert spec.final_states == {"b"}
    assert spec.edges() == [("go", "a", "b")]


@pytest.mark.parametrize("text, expected", [
    pytest.param(BASE.replace("source: a", "source: [a, zz]"),
                 "bad.yaml: transitions[0].source[1], line 9: unknown source state 'zz' for "
                 "trigger 'go'; known: ['a', 'b']", id="unknown-source-in-list"),
    pytest.param(BASE.replace("source: a", "source: zz"),
                 "bad.yaml: transitions[0].source, line 9: unknown source state 'zz' for trigger "
                 "'go'; known: ['a', 'b']", id="unknown-source-scalar"),
    pytest.param(BASE.replace("dest: b", "dest: zz"),
                 "bad.yaml: transitions[0].dest, line 10: unknown destination state 'zz' for "
                 "trigger 'go'", id="unknown-dest"),
    pytest.param(BASE.replace("initial: a", "initial: zz"),
                 "bad.yaml: initial, line 2: unknown state 'zz'; known: ['a', 'b']",
                 id="unknown-initial"),
    pytest.param(BASE.replace("    source: a\n", ""),
                 "bad.yaml: transitions[0].source, line 8: missing required key 'source'",
                 id="no-source"),
    pytest.param(BASE.replace("source: a", "source: []"),
                 "bad.yaml: transitions[0].source, line 9: 'source' must not be empty",
                 id="empty-source"),
    pytest.param(BASE.replace("source: a", "source:"),
                 "bad.yaml: transitions[0].source, line 9: 'source' must not be empty",
                 id="null-source"),
    pytest.param(BASE + "  - trigger: go\n    source: a\n    dest: a\n",
                 "bad.yaml: transitions[1].trigger, line 11: duplicate trigger/source pair ('go', "
                 "'a'); first at transitions[0]", id="duplicate-trigger-source"),
    pytest.param(BASE.replace("  - name: b\n", "  - name: a\n  - name: b\n"),
                 "bad.yaml: states[1].name, line 5: duplicate state 'a'", id="duplicate-state"),
    pytest.param(BASE.replace("    dest: b\n", "    dest: b\n    colour: red\n"),
                 "bad.yaml: transitions[0].colour, line 11: unknown key 'colour'",
                 id="unknown-key-in-transition"),
    pytest.param(BASE + "extra: 1\n", "bad.yaml: extra, line 11: unknown key 'extra'",
                 id="unknown-top-key"),
    pytest.param(BASE.replace("    dest: b\n", "    dest: b\n    dest: a\n"),
                 "bad.yaml: transitions[0].dest, line 11: duplicate key 'dest' (first at line 10)",
                 id="repeated-yaml-key"),
    pytest.param(BASE.replace("initial: a\n", ""),
                 "bad.yaml: initial, line 1: missing required key 'initial'", id="missing-initial"),
    pytest.param("- a\n- b\n",
                 "bad.yaml: <top>, line 1: top level must be a mapping with "
                 "name/initial/states/transitions, got a list", id="not-a-mapping"),
    pytest.param("", "bad.yaml: <top>, line 1: top level must be a mapping with "
                     "name/initial/states/transitions, got None", id="empty-file"),
    pytest.param("name: [a\n", "bad.yaml: <yaml>, line 2, column 1: not valid YAML: expected ',' "
                               "or ']', but got '<stream end>'", id="yaml-syntax"),
])
def test_malformed_spec_is_rejected_with_path_and_line(text, expected):
    assert _error(text) == expected


def test_state_that_is_not_a_mapping_names_item_line():
    msg = _error(BASE.replace("  - name: b\n    final: true\n", "  - b\n"))
    assert msg.startswith("bad.yaml: states[1], line 5: ")
    assert "valid dictionary" in msg


@pytest.mark.parametrize("name, initial, n_states, n_edges, finals", [
    ("request", "waiting", 6, 9, {"finished_stopped", "finished_length", "finished_aborted"}),
    ("slot", "free", 2, 2, set()),
    ("block", "free", 3, 7, set()),
    ("pp_handler", "empty", 3, 5, {"consumed"}),
])
def test_real_specs_load(name, initial, n_states, n_edges, finals):
    spec = load_table(name)
    assert spec.initial == initial
    assert len(spec.state_names) == n_states
    assert len(spec.edges()) == n_edges
    assert spec.final_states == finals


def test_load_spec_from_directory_and_missing_file(tmp_path):
    (tmp_path / "m.yaml").write_text(BASE)
    assert load_table("m", specs_dir=tmp_path).edges() == [("go", "a", "b")]
    with pytest.raises(TableError, match=r"nope\.yaml: spec file not found"):
        load_table("nope", specs_dir=tmp_path)
    assert (SPECS_DIR / "request.yaml").is_file()


def test_same_destination_resolves_to_source():
    spec = load_table("pp_handler")
    assert ("free", "pending", "pending") in spec.edges()
    assert ("free", "empty", "empty") in spec.edges()
