"""Request lifecycle: every legal edge of specs/request.yaml, every illegal pair, guards, and the
rule that the machine is the only writer of a request's ``state``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ppstate.errors import IllegalTransition
from ppstate.lifecycle import Lifecycle
from ppstate.state_tables import load_table

SPEC = load_table("request")
# The lifecycle as docs/design.md §4 states it, written out here rather than read from
# specs/request.yaml (the table the machine is built from), so a wrong spec cannot pass.
STATES = ["waiting", "prefilling", "decoding", "finished_stopped", "finished_length",
          "finished_aborted"]
FINAL = {"finished_stopped", "finished_length", "finished_aborted"}
EDGES = [("admit", "waiting", "prefilling"), ("complete_prefill", "prefilling", "decoding"),
         ("stop", "decoding", "finished_stopped"), ("hit_length", "decoding", "finished_length"),
         ("abort", "waiting", "finished_aborted"), ("abort", "prefilling", "finished_aborted"),
         ("abort", "decoding", "finished_aborted"),
         # recompute preemption (paged KV cache out of blocks): back to waiting, tokens kept
         ("preempt", "prefilling", "waiting"), ("preempt", "decoding", "waiting")]
GUARDED = {"admit": "has_slot", "complete_prefill": "prefill_fully_scheduled"}
LEGAL = {(trigger, source) for trigger, source, _ in EDGES}
TRIGGERS = sorted({t for t, _, _ in EDGES})
ILLEGAL = [(t, s) for s in STATES for t in TRIGGERS if (t, s) not in LEGAL]
ROOT = Path(__file__).resolve().parents[2]

# Shortest trigger path from ``waiting`` to each state (guards all passing).
PATH_TO = {"waiting": [], "prefilling": ["admit"], "decoding": ["admit", "complete_prefill"],
           "finished_stopped": ["admit", "complete_prefill", "stop"],
           "finished_length": ["admit", "complete_prefill", "hit_length"],
           "finished_aborted": ["abort"]}


class Req:
    """Minimal request model: ``req_id`` plus the guard methods request.yaml names."""

    def __init__(self, req_id: str, slot_ok: bool = True, prefill_done: bool = True) -> None:
        self.req_id, self.slot_ok, self.prefill_done = req_id, slot_ok, prefill_done

    def has_slot(self) -> bool:
        return self.slot_ok

    def prefill_fully_scheduled(self) -> bool:
        return self.prefill_done


def _at(lc: Lifecycle, state: str, req_id: str = "r1") -> Req:
    req = Req(req_id)
    lc.add(req)
    for trigger in PATH_TO[state]:
        lc.fire(req, trigger)
    assert req.state == state
    return req


def test_path_table_covers_every_state():
    assert sorted(PATH_TO) == sorted(STATES)


def test_spec_table_is_the_stated_lifecycle():
    """specs/request.yaml holds exactly these states, edges, guards and final states."""
    assert sorted(SPEC.state_names) == sorted(STATES)
    assert sorted(SPEC.edges()) == sorted(EDGES)
    assert {t.trigger: list(t.guards) for t in SPEC.transitions if t.guards} == \
        {k: [v] for k, v in GUARDED.items()}
    lc = Lifecycle()
    assert {s for s in STATES if lc.is_final(s)} == FINAL


def test_new_request_starts_waiting():
    lc = Lifecycle()
    req = Req("r0")
    lc.add(req)
    assert req.state == "waiting"


@pytest.mark.parametrize("trigger, source, dest", EDGES, ids=[f"{t}:{s}" for t, s, _ in EDGES])
def test_legal_edge_reaches_stated_destination(trigger, source, dest):
    lc = Lifecycle()
    req = _at(lc, source)
    assert lc.fire(req, trigger) == dest
    assert req.state == dest


@pytest.mark.parametrize("trigger, state", ILLEGAL, ids=[f"{t}:{s}" for t, s in ILLEGAL])
def test_illegal_pair_raises_naming_request_state_trigger(trigger, state):
    lc = Lifecycle()
    req = _at(lc, state, req_id="req-7")
    with pytest.raises(IllegalTransition) as info:
        lc.fire(req, trigger)
    err = info.value
    assert (err.req_id, err.state, err.trigger) == ("req-7", state, trigger)
    assert str(err) == (f"request 'req-7' in state {state!r} cannot take trigger {trigger!r}: "
                        "no such edge")
    assert req.state == state


def test_illegal_pairs_count():
    # 6 states x 6 triggers = 36 pairs, 9 legal edges (preempt from prefilling and decoding).
    assert (len(ILLEGAL), len(LEGAL)) == (27, 9)


def test_unknown_trigger_raises():
    lc = Lifecycle()
    req = _at(lc, "decoding")
    with pytest.raises(IllegalTransition, match="cannot take trigger 'explode': unknown trigger"):
        lc.fire(req, "explode")
    assert req.state == "decoding"


def test_admit_guard_false_raises_and_keeps_state():
    lc = Lifecycle()
    req = Req("r2", slot_ok=False)
    lc.add(req)
    with pytest.raises(IllegalTransition) as info:
        lc.fire(req, "admit")
    assert str(info.value) == ("request 'r2' in state 'waiting' cannot take trigger 'admit': "
                               "guard returned False")
    assert req.state == "waiting"


def test_complete_prefill_guard_false_raises_then_passes():
    lc = Lifecycle()
    req = Req("r3", prefill_done=False)
    lc.add(req)
    lc.fire(req, "admit")
    with pytest.raises(IllegalTransition, match="'prefilling' cannot take trigger "
                                                "'complete_prefill': guard returned False"):
        lc.fire(req, "complete_prefill")
    assert req.state == "prefilling"
    req.prefill_done = True
    assert lc.fire(req, "complete_prefill") == "decoding"


def test_many_requests_share_one_machine():
    lc = Lifecycle()
    a, b = _at(lc, "decoding", "a"), _at(lc, "waiting", "b")
    lc.fire(a, "stop")
    assert (a.state, b.state) == ("finished_stopped", "waiting")
    assert lc.is_final(a.state) and not lc.is_final(b.state)
    lc.remove(a)
    assert a not in lc.machine.models and b in lc.machine.models


GUARDS = set(GUARDED.values())


def _is_request_class(cls: ast.ClassDef) -> bool:
    """A lifecycle model: named *Request* or defining one of request.yaml's guard methods."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return cls.name.endswith("Request") or bool(methods & GUARDS)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        out = [node.target]
    else:
        return []
    flat = []
    while out:
        t = out.pop(0)
        if isinstance(t, (ast.Tuple, ast.List)):
            out.extend(t.elts)
        else:
            flat.append(t)
    return flat


def _writes_state(node: ast.AST, in_request: bool) -> bool:
    """``x.state = ...`` (x not ``self``, or ``self`` in a request class) or
    ``setattr(_, "state", _)``."""
    for t in _targets(node):
        if isinstance(t, ast.Attribute) and t.attr == "state":
            is_self = isinstance(t.value, ast.Name) and t.value.id == "self"
            if in_request or not is_self:
                return True
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "setattr" and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and node.args[1].value == "state")


def _scan(node: ast.AST, in_request: bool, hits: list[int]) -> None:
    if isinstance(node, ast.ClassDef):
        in_request = _is_request_class(node)
    if _writes_state(node, in_request):
        hits.append(node.lineno)
    for child in ast.iter_child_nodes(node):
        _scan(child, in_request, hits)


def _state_writes(root: Path) -> list[str]:
    """``path:line: source`` of every write to a request's ``state`` under ppstate/ and runtime/.

    ``self.state`` of a class that is not a request model (e.g. a worker's device state) is
    not a request's state and is allowed.
    """
    hits = []
    for folder in ("ppstate", "runtime"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            lines: list[int] = []
            _scan(ast.parse(text, filename=str(path)), False, lines)
            src = text.splitlines()
            hits += [f"{path.relative_to(root)}:{n}: {src[n - 1].strip()}" for n in sorted(lines)]
    return hits


def test_state_write_scan_finds_planted_writes(tmp_path):
    (tmp_path / "ppstate").mkdir()
    (tmp_path / "runtime").mkdir()
    (tmp_path / "ppstate" / "x.py").write_text(
        "if req.state == 'a':\n    req.state = 'b'\nok = r.state != 1\n"
        "a, r.state = 1, 2\nsetattr(r, 'state', 3)\n")
    (tmp_path / "runtime" / "y.py").write_text(
        "class Worker:\n    def __init__(self, s):\n        self.g, self.state = 1, s\n"
        "class MyRequest:\n    def __init__(self):\n        self.state = 'waiting'\n"
        "class Model:\n    def has_slot(self):\n        self.state: str = 'x'\n")
    assert _state_writes(tmp_path) == [
        "ppstate/x.py:2: req.state = 'b'", "ppstate/x.py:4: a, r.state = 1, 2",
        "ppstate/x.py:5: setattr(r, 'state', 3)", "runtime/y.py:6: self.state = 'waiting'",
        "runtime/y.py:9: self.state: str = 'x'"]


def test_only_the_machine_writes_request_state():
    assert _state_writes(ROOT) == [], "assign request state only through Lifecycle.fire"
