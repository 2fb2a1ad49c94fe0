"""Load and validate the state-machine tables in ``specs/*.yaml``.

The YAML is parsed with line marks, then validated by pydantic models; any problem raises
:class:`~ppstate.errors.TableError` naming the file, the key path (``transitions[2].source``) and
the line. Checked: YAML syntax, a top level that is not a mapping, repeated keys in one mapping
(plain YAML keeps the last silently), unknown and missing keys, unknown states in
sources/destinations/initial, a transition with no (or an empty) source, duplicate state names,
duplicate (trigger, source) pairs.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ppstate.errors import TableError



def _specs_dir() -> Path:
    """Where the state tables are: ``ppstate/specs/`` inside an installed (non-editable) package,
    found through :mod:`importlib.resources` (setup.py copies ``specs/*.yaml`` there when it
    builds the wheel), else ``specs/`` next to the package (a source checkout, an editable
    install). A zipped install is not supported (the tables are read as files)."""
    shipped = resources.files("ppstate") / "specs"
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parent.parent / "specs"


#: the directory of the state tables (``specs/`` of the repository, or its copy in the package)
SPECS_DIR = _specs_dir()

#: Destination meaning "stay in the source state" (a transition with effects only).
SAME = "="


class StateRow(BaseModel):
    """One state of a machine."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    final: bool = False
    doc: str = ""


class TransitionRow(BaseModel):
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
        return [v] if isinstance(v, str) else ([] if v is None else v)


class MachineTable(BaseModel):
    """A whole machine: its states, initial state and transitions."""
    model_config = ConfigDict(extra="forbid")
    name: str
    initial: str
    states: list[StateRow] = Field(min_length=1)
    transitions: list[TransitionRow]
    _file: str = PrivateAttr(default="<string>")

    @property
    def file(self) -> str:
        """The file the table was read from (``<string>`` for a parsed text)."""
        return self._file

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


_LINE, _KEYLINES, _DUPES = "__line__", "__keylines__", "__dupes__"
_MARKS = (_LINE, _KEYLINES, _DUPES)


class _LineList(list):
    """A YAML sequence that remembers the line of each item in ``lines``."""
    lines: list[int]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records lines: mappings get ``__line__`` (their start), ``__keylines__``
    (key -> line) and ``__dupes__`` (repeated keys, which plain YAML silently collapses)."""


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    keylines: dict[Any, int] = {}
    dupes: list[tuple[Any, int, int]] = []
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in keylines:
                dupes.append((key, line, keylines[key]))
                continue
            keylines[key] = line
        except TypeError:  # unhashable key: construct_mapping below reports it
            pass
    mapping = loader.construct_mapping(node, deep=True)
    mapping.update({_LINE: node.start_mark.line + 1, _KEYLINES: keylines, _DUPES: dupes})
    return mapping


def _construct_sequence(loader: _LineLoader, node: yaml.SequenceNode) -> list:
    seq = _LineList(loader.construct_sequence(node, deep=True))
    seq.lines = [item.start_mark.line + 1 for item in node.value]
    return seq


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


def _strip_lines(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_lines(v) for k, v in obj.items() if k not in _MARKS}
    if isinstance(obj, list):
        return [_strip_lines(v) for v in obj]
    return obj


def _line_of(raw: Any, loc: tuple) -> int | None:
    """Line of the innermost key / item of ``loc`` that exists in ``raw`` (1-based)."""
    line, node = None, raw
    for part in loc:
        if isinstance(node, dict):
            line = node.get(_KEYLINES, {}).get(part, node.get(_LINE, line))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            line = getattr(node, "lines", [line] * len(node))[part]
            node = node[part]
        else:
            break
    return line


def _find_duplicate_key(node: Any, loc: tuple = ()) -> tuple[tuple, str, int] | None:
    """First repeated mapping key in document order, as (key path, message, line)."""
    if isinstance(node, dict):
        for key, line, first in node.get(_DUPES, []):
            return loc + (key,), f"duplicate key {key!r} (first at line {first})", line
        items = [(k, v) for k, v in node.items() if k not in _MARKS]
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return None
    for k, v in items:
        found = _find_duplicate_key(v, loc + (k,))
        if found:
            return found
    return None


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top>"


def _fail(file: str, raw: Any, loc: tuple, msg: str, line: int | None = None) -> TableError:
    line = line or _line_of(raw, loc)
    at = f", line {line}" if line else ""
    return TableError(f"{file}: {_path(loc)}{at}: {msg}")


def _pydantic_message(err: dict) -> str:
    """A message naming the problem in spec terms rather than pydantic's."""
    key = err["loc"][-1] if err["loc"] else "<top>"
    if err["type"] == "extra_forbidden":
        return f"unknown key {key!r}"
    if err["type"] == "missing":
        return f"missing required key {key!r}"
    if err["type"] == "too_short":
        return f"{key!r} must not be empty"
    return err["msg"]


def _source_loc(raw: Any, i: int, j: int) -> tuple:
    """Key path of source ``j`` of transition ``i`` (the item itself when source is a list)."""
    src = raw["transitions"][i]["source"]
    loc = ("transitions", i, "source")
    return loc + (j,) if isinstance(src, list) else loc


def _check_semantics(file: str, raw: Any, spec: MachineTable) -> None:
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
                raise _fail(file, raw, _source_loc(raw, i, t.source.index(s)),
                            f"unknown source state {s!r} for trigger {t.trigger!r}; known: {names}")
            if (t.trigger, s) in pairs:
                raise _fail(file, raw, ("transitions", i, "trigger"),
                            f"duplicate trigger/source pair ({t.trigger!r}, {s!r}); first at "
                            f"transitions[{pairs[(t.trigger, s)]}]")
            pairs[(t.trigger, s)] = i
        if t.dest != SAME and t.dest not in seen:
            raise _fail(file, raw, ("transitions", i, "dest"),
                        f"unknown destination state {t.dest!r} for trigger {t.trigger!r}")


def parse_table(text: str, file: str = "<string>") -> MachineTable:
    """Parse and validate one machine table.

    Raises:
        TableError: malformed YAML or any rule above broken; names ``file``, key path and line.
    """
    try:
        raw = yaml.load(text, Loader=_LineLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        problem = exc.problem or exc.context
        raise TableError(f"{file}: <yaml>, {at}: not valid YAML: {problem}") from exc
    except yaml.YAMLError as exc:
        raise TableError(f"{file}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        got = "a list" if isinstance(raw, list) else repr(raw)
        raise TableError(f"{file}: <top>, line 1: top level must be a mapping with "
                        f"name/initial/states/transitions, got {got}")
    dup = _find_duplicate_key(raw)
    if dup:
        raise _fail(file, raw, *dup)
    try:
        spec = MachineTable.model_validate(_strip_lines(raw))
    except ValidationError as exc:
        err = exc.errors()[0]
        raise _fail(file, raw, tuple(err["loc"]), _pydantic_message(err)) from None
    _check_semantics(file, raw, spec)
    spec._file = file
    return spec


def load_table(name: str, specs_dir: Path | None = None) -> MachineTable:
    """Load ``specs/<name>.yaml`` (cached for the default directory).

    Raises:
        TableError: file missing or malformed.
    """
    if specs_dir is None:
        return _load_default(name)
    return _load(Path(specs_dir) / f"{name}.yaml")


@lru_cache(maxsize=None)
def _load_default(name: str) -> MachineTable:
    return _load(SPECS_DIR / f"{name}.yaml")


def _load(path: Path) -> MachineTable:
    if not path.is_file():
        raise TableError(f"{path}: spec file not found")
    return parse_table(path.read_text(), file=str(path))
