"""Load and validate the state-machine tables in ``specs/*.yaml``.

The YAML is parsed with line marks, then validated by pydantic models; any problem raises
:class:`~ppstate.errors.SpecError` naming the file, the key path (``transitions[2].source``) and
the line. Checked: unknown keys, unknown states in sources/destinations/initial, a transition with
no source, duplicate state names, duplicate (trigger, source) pairs.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ppstate.errors import SpecError

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"

#: Destination meaning "stay in the source state" (a transition with effects only).
SAME = "="


class StateSpec(BaseModel):
    """One state of a machine."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    final: bool = False
    doc: str = ""


class TransitionSpec(BaseModel):
    """One edge (or fan-in of edges): ``trigger`` from each of ``source`` to ``dest``."""
    model_config = ConfigDict(extra="forbid")
    trigger: str = Field(min_length=1)
    source: list[str] = Field(min_length=1)
    dest: str = Field(min_length=1)
    guards: list[str] = []
    effects: list[str] = []
    doc: str = ""

    @field_validator("source", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


class MachineSpec(BaseModel):
    """A whole machine: its states, initial state and transitions."""
    model_config = ConfigDict(extra="forbid")
    name: str
    initial: str
    states: list[StateSpec] = Field(min_length=1)
    transitions: list[TransitionSpec]

    @property
    def state_names(self) -> list[str]:
        return [s.name for s in self.states]

    @property
    def final_states(self) -> set[str]:
        return {s.name for s in self.states if s.final}

    def edges(self) -> list[tuple[str, str, str]]:
        """All (trigger, source, dest) triples, ``=`` resolved to the source."""
        return [(t.trigger, s, s if t.dest == SAME else t.dest)
                for t in self.transitions for s in t.source]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records the line of every mapping under the key ``__line__``."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    mapping = loader.construct_mapping(node, deep=True)
    mapping["__line__"] = node.start_mark.line + 1
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _strip_lines(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_lines(v) for k, v in obj.items() if k != "__line__"}
    if isinstance(obj, list):
        return [_strip_lines(v) for v in obj]
    return obj


def _line_of(raw: Any, loc: tuple) -> int | None:
    line, node = None, raw
    for part in loc:
        if isinstance(node, dict):
            line = node.get("__line__", line)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            break
    if isinstance(node, dict):
        line = node.get("__line__", line)
    return line


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


def _fail(file: str, raw: Any, loc: tuple, msg: str) -> SpecError:
    line = _line_of(raw, loc)
    at = f", line {line}" if line else ""
    return SpecError(f"{file}: {_path(loc)}{at}: {msg}")


def _check_semantics(file: str, raw: Any, spec: MachineSpec) -> None:
    names = spec.state_names
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise _fail(file, raw, ("states", i, "name"), f"duplicate state {name!r}")
        seen.add(name)
    if spec.initial not in seen:
        raise _fail(file, raw, ("initial",), f"unknown state {spec.initial!r}; known: {names}")
    pairs: dict[tuple[str, str], int] = {}
    for i, t in enumerate(spec.transitions):
        for s in t.source:
            if s not in seen:
                raise _fail(file, raw, ("transitions", i, "source"),
                            f"unknown source state {s!r} for trigger {t.trigger!r}; known: {names}")
            if (t.trigger, s) in pairs:
                raise _fail(file, raw, ("transitions", i, "trigger"),
                            f"duplicate trigger/source pair ({t.trigger!r}, {s!r}); first at "
                            f"transitions[{pairs[(t.trigger, s)]}]")
            pairs[(t.trigger, s)] = i
        if t.dest != SAME and t.dest not in seen:
            raise _fail(file, raw, ("transitions", i, "dest"),
                        f"unknown destination state {t.dest!r} for trigger {t.trigger!r}")


def parse_spec(text: str, file: str = "<string>") -> MachineSpec:
    """Parse and validate one machine table.

    Raises:
        SpecError: malformed YAML or any rule above broken; names ``file``, key path and line.
    """
    try:
        raw = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        raise SpecError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"{file}: top level must be a mapping with name/initial/states/transitions")
    try:
        spec = MachineSpec.model_validate(_strip_lines(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise _fail(file, raw, tuple(err["loc"]), err["msg"]) from None
    _check_semantics(file, raw, spec)
    return spec


def load_spec(name: str, specs_dir: Path | None = None) -> MachineSpec:
    """Load ``specs/<name>.yaml`` (cached for the default directory).

    Raises:
        SpecError: file missing or malformed.
    """
    if specs_dir is None:
        return _load_default(name)
    return _load(Path(specs_dir) / f"{name}.yaml")


@lru_cache(maxsize=None)
def _load_default(name: str) -> MachineSpec:
    return _load(SPECS_DIR / f"{name}.yaml")


def _load(path: Path) -> MachineSpec:
    if not path.is_file():
        raise SpecError(f"{path}: spec file not found")
    return parse_spec(path.read_text(), file=str(path))
