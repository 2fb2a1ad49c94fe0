"""Generated mermaid diagrams: exact rendering, and the committed specs/*.mmd stay in sync."""

from __future__ import annotations

import pytest

from ppstate.diagrams import SPEC_NAMES, generate, main, render_mermaid, stale
from ppstate.state_tables import SPECS_DIR, parse_table

SMALL = """\
name: m
initial: a
states:
  - name: a
  - name: b
  - name: c
    final: true
transitions:
  - trigger: to_c
    source: [b, a]
    dest: c
  - trigger: go
    source: a
    dest: b
    guards: [ready, allowed]
  - trigger: poke
    source: b
    dest: "="
    effects: [bump, log]
"""

SMALL_MMD = """\
stateDiagram-v2
    %% Generated from specs/m.yaml by `python -m ppstate.diagrams` (make diagrams).
    %% Do not edit: change the YAML table and regenerate.
    [*] --> a
    a --> c : to_c
    a --> b : go [ready and allowed]
    b --> c : to_c
    b --> b : poke / bump, log
    c --> [*]
"""


def test_render_exact_text():
    assert render_mermaid(parse_table(SMALL), "specs/m.yaml") == SMALL_MMD


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_committed_diagram_matches_spec(name):
    path = SPECS_DIR / f"{name}.mmd"
    expected = generate()[path]
    assert path.is_file(), f"{path} is missing: run `make diagrams`"
    assert path.read_text() == expected, (
        f"{path} differs from what specs/{name}.yaml generates: run `make diagrams`")


def test_request_diagram_has_every_edge_and_final_state():
    text = generate()[SPECS_DIR / "request.mmd"]
    assert "    waiting --> prefilling : admit [has_slot]\n" in text
    assert "    prefilling --> decoding : complete_prefill [prefill_fully_scheduled]\n" in text
    # request.yaml names the effects of the finishing edges (bound to RequestQueues methods)
    assert text.count(" : abort / free_blocks, free_slot\n") == 3
    assert text.count(" --> [*]\n") == 3


def _copy_specs(tmp_path):
    for name in SPEC_NAMES:
        (tmp_path / f"{name}.yaml").write_text((SPECS_DIR / f"{name}.yaml").read_text())


def test_main_writes_then_check_passes(tmp_path, capsys):
    _copy_specs(tmp_path)
    assert main(["--specs-dir", str(tmp_path), "--check"]) == 1
    assert sorted(stale(tmp_path)) == sorted(tmp_path / f"{n}.mmd" for n in SPEC_NAMES)
    assert main(["--specs-dir", str(tmp_path)]) == 0
    assert main(["--specs-dir", str(tmp_path), "--check"]) == 0
    for name in SPEC_NAMES:
        assert (tmp_path / f"{name}.mmd").read_text() == (SPECS_DIR / f"{name}.mmd").read_text()


def test_check_reports_an_edited_table(tmp_path, capsys):
    _copy_specs(tmp_path)
    main(["--specs-dir", str(tmp_path)])
    capsys.readouterr()
    slot = tmp_path / "slot.yaml"
    slot.write_text(slot.read_text().replace("trigger: release", "trigger: give_back"))
    assert stale(tmp_path) == [tmp_path / "slot.mmd"]
    assert main(["--specs-dir", str(tmp_path), "--check"]) == 1
    assert capsys.readouterr().err == f"stale: {tmp_path / 'slot.mmd'} (run `make diagrams`)\n"
