"""Writing benchmark results: one JSON file with the date, the machine and the command.

Every ``runtime.bench`` subcommand that writes ``--json-out FILE`` goes through
:func:`write_result`, so ``benchmarks/results/*.json`` all carry ``date`` (UTC, ISO 8601),
``machine`` (:func:`machine_description`), ``command`` (the exact command line) and ``results``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path


def machine_description() -> str:
    """One line: CPU model, logical CPUs, memory, OS, Python, torch (when importable) and GPU."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    parts = [f"{cpu}, {os.cpu_count()} logical CPUs{mem}", f"{platform.system()} "
             f"{platform.release()}", f"Python {platform.python_version()}"]
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return "; ".join(parts)


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``python -m runtime.bench`` + the arguments."""
    args = sys.argv[1:] if argv is None else argv
    return "python -m runtime.bench " + shlex.join(args)


def subcommand_line(name: str, argv: list[str] | None) -> str:
    """:func:`command_line` of subcommand ``name`` run as ``main(argv)``; ``argv`` None = the
    process's own arguments (already starting with ``name``)."""
    return command_line([name, *argv]) if argv is not None else command_line()


def write_result(path: str | Path, kind: str, results: dict, args: dict, command: str) -> Path:
    """Write ``{"kind", "date", "machine", "command", "args", "results"}`` to ``path`` (parents
    created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"kind": kind, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "machine": machine_description(), "command": command,
        "args": args, "results": results}
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out
