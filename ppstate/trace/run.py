"""Run directories of a trace: one per run, never shared.

``--trace-dir DIR`` makes a fresh ``DIR/run-<UTC time>-<6 hex>/`` (created with
``exist_ok=False``), writes ``header.json`` there first and then one JSON-lines file per process:
``engine.jsonl`` (the scheduler) and ``rank<N>.jsonl`` (each PP rank). A later run gets a new
directory, so runs never mix. Readers accept the run directory itself or ``DIR`` (the newest run).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import secrets
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ppstate.budget import SchedulerConfig
from ppstate.errors import PPStateError
from ppstate.events import read_jsonl
from ppstate.trace.models import OPTIONAL_HEADER_FIELDS, TRACE_FORMAT_VERSION, RunHeader

HEADER = "header.json"
ENGINE_FILE = "engine.jsonl"


class TraceError(PPStateError):
    """A trace directory that cannot be read (missing header, unknown version, bad line)."""


def new_run_dir(base: str | Path) -> Path:
    """Create and return a new, empty run directory under ``base``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(base) / f"run-{stamp}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def package_versions(*names: str) -> dict[str, str]:
    """``{name: version}`` of installed distributions (missing ones are left out) + python."""
    out = {"python": platform.python_version()}
    for n in ("ppstate", "numpy", "pydantic", "transitions", *names):
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return out


def write_header(run_dir: Path, source: str, sched: SchedulerConfig, config: dict[str, Any],
                 seed: int | None = None, trace_prompts: bool = False,
                 versions: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> RunHeader:
    """Write ``header.json`` of a run (before any event file); ``extra``: further
    :class:`RunHeader` fields (``recorded_violations``, ``mutants``, ``repro``, ...)."""
    files = [ENGINE_FILE] + ([f"rank{r}.jsonl" for r in range(sched.pp_size)]
                             if source == "engine" else [])
    header = RunHeader(run_id=run_dir.name, source=source, created_unix_s=time.time(),
                       pp_size=sched.pp_size, scheduler=dataclasses.asdict(sched), config=config,
                       seed=seed, versions=versions or package_versions(),
                       trace_prompts=trace_prompts, files=files, **(extra or {}))
    unset = {k for k in OPTIONAL_HEADER_FIELDS if getattr(header, k) is None}
    (run_dir / HEADER).write_text(header.model_dump_json(indent=2, exclude=unset) + "\n",
                                  encoding="utf-8")
    return header


def write_run(base: str | Path, source: str, sched: SchedulerConfig, config: dict[str, Any],
              engine_events: list[dict[str, Any]],
              rank_events: dict[int, list[dict[str, Any]]] | None = None,
              seed: int | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write a whole run produced in memory (simulator, model checker) as a new run directory
    under ``base``: header (``extra``: further header fields), ``engine.jsonl`` and any
    ``rank<N>.jsonl``. Returns the directory."""
    run_dir = new_run_dir(base)
    write_header(run_dir, source, sched, config, seed=seed, extra=extra)
    files = {ENGINE_FILE: engine_events, **{f"rank{r}.jsonl": ev
                                            for r, ev in (rank_events or {}).items()}}
    for name, events in files.items():
        with (run_dir / name).open("x", encoding="utf-8") as fh:
            fh.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
    return run_dir


def find_run_dir(path: str | Path) -> Path:
    """``path`` itself when it holds a header, else its newest ``run-*`` child.

    Raises:
        TraceError: neither.
    """
    p = Path(path)
    if (p / HEADER).is_file():
        return p
    runs = sorted(c for c in p.glob("run-*") if (c / HEADER).is_file()) if p.is_dir() else []
    if not runs:
        hint = (" (a --dp run records each replica under replica<i>/: replay DIR/replica0, ...)"
                if any(p.glob("replica*/run-*")) else "")
        raise TraceError(f"{p}: no {HEADER} here and no run-* directory holding one{hint}")
    return runs[-1]


@dataclass
class TraceRun:
    """A run read back: header, the engine's events, each rank's events (flat dicts)."""
    path: Path
    header: RunHeader
    engine: list[dict[str, Any]]
    ranks: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(**self.header.scheduler)

    @property
    def num_events(self) -> int:
        return len(self.engine) + sum(len(v) for v in self.ranks.values())


def load_run(path: str | Path) -> TraceRun:
    """Read the run at ``path`` (see :func:`find_run_dir`).

    Raises:
        TraceError: no header, a newer format version, no engine.jsonl, or a corrupt line.
    """
    run_dir = find_run_dir(path)
    try:
        header = RunHeader.model_validate_json((run_dir / HEADER).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TraceError(f"{run_dir / HEADER}: {exc}") from exc
    if header.version > TRACE_FORMAT_VERSION:
        raise TraceError(f"{run_dir}: trace format version {header.version} is newer than this "
                         f"reader's {TRACE_FORMAT_VERSION}")
    if not (run_dir / ENGINE_FILE).is_file():
        raise TraceError(f"{run_dir}: no {ENGINE_FILE}")
    try:
        engine = read_jsonl(run_dir / ENGINE_FILE)
        ranks = {r: read_jsonl(run_dir / f"rank{r}.jsonl") for r in range(header.pp_size)
                 if (run_dir / f"rank{r}.jsonl").is_file()}
    except json.JSONDecodeError as exc:
        raise TraceError(f"{run_dir}: corrupt trace line: {exc}") from exc
    return TraceRun(run_dir, header, engine, ranks)
