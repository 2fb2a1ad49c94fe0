"""Mermaid ``stateDiagram-v2`` diagrams generated from the ``specs/*.yaml`` machine tables.

Run ``python -m ppstate.diagrams`` (or ``make diagrams``) to rewrite ``specs/<name>.mmd`` next to
each table; ``--check`` only reports stale diagrams (exit status 1). tests/tools/test_diagrams.py fails
when a committed diagram differs from what the tables generate.

Output is deterministic: ``[*] --> initial`` first, then the edges grouped by source state in the
table's state order (within a source, in transition order), then ``final --> [*]`` for each final
state. An edge label is the trigger, then ``[guard and guard]`` when guarded, then ``/ effect, ...``
when the transition has effects (UML's ``trigger [guard] / effect``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ppstate.state_tables import SAME, SPECS_DIR, MachineTable, TransitionRow, load_table

#: The machine tables that get a diagram (file stems in ``specs/``).
SPEC_NAMES = ("request", "slot", "pp_handler", "block")


def edge_label(t: TransitionRow) -> str:
    """``trigger [g1 and g2] / e1, e2`` for one transition (guard and effect parts optional)."""
    label = t.trigger
    if t.guards:
        label += f" [{' and '.join(t.guards)}]"
    if t.effects:
        label += f" / {', '.join(t.effects)}"
    return label


def render_mermaid(spec: MachineTable, source: str) -> str:
    """The mermaid text for ``spec``; ``source`` (e.g. ``specs/request.yaml``) goes in the header.

    Returns:
        newline-terminated ``stateDiagram-v2`` text.
    """
    lines = ["stateDiagram-v2",
             f"    %% Generated from {source} by `python -m ppstate.diagrams` (make diagrams).",
             "    %% Do not edit: change the YAML table and regenerate.",
             f"    [*] --> {spec.initial}"]
    for state in spec.state_names:
        for t in spec.transitions:
            if state in t.source:
                dest = state if t.dest == SAME else t.dest
                lines.append(f"    {state} --> {dest} : {edge_label(t)}")
    lines += [f"    {state} --> [*]" for state in spec.state_names if state in spec.final_states]
    return "\n".join(lines) + "\n"


def generate(specs_dir: Path = SPECS_DIR,
             names: Sequence[str] = SPEC_NAMES) -> dict[Path, str]:
    """Diagram path -> expected text for each table in ``names``.

    Raises:
        TableError: a table is missing or malformed.
    """
    specs_dir = Path(specs_dir)
    return {specs_dir / f"{name}.mmd":
            render_mermaid(load_table(name, specs_dir), f"specs/{name}.yaml")
            for name in names}


def stale(specs_dir: Path = SPECS_DIR, names: Sequence[str] = SPEC_NAMES) -> list[Path]:
    """Diagrams that are missing or differ from what their tables generate."""
    return [path for path, text in generate(specs_dir, names).items()
            if not path.is_file() or path.read_text() != text]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write the diagrams (default) or ``--check`` them. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ppstate.diagrams", description=__doc__)
    parser.add_argument("--specs-dir", type=Path, default=SPECS_DIR)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a diagram is stale")
    args = parser.parse_args(argv)
    outdated = stale(args.specs_dir)
    if args.check:
        for path in outdated:
            print(f"stale: {path} (run `make diagrams`)", file=sys.stderr)
        return 1 if outdated else 0
    expected = generate(args.specs_dir)
    for path in outdated:
        path.write_text(expected[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from ppstate.cli_pipe import run_main
    sys.exit(run_main(main))
