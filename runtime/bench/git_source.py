"""An older version of a repository module, loaded at run time to benchmark against (no frozen
copy in the tree).

:func:`load_module` reads ``path`` as it was at a git revision (``git show REV:PATH``), or from a
folder of files extracted beforehand (a machine without the repository's ``.git``, e.g. the GPU
device: ``git show REV:PATH > DIR/NAME`` on this side, the folder carried along), and executes it
as a fresh module under its own name. The old module imports the current versions of whatever it
imports, so it must still agree with their interfaces (the benchmark using it says which).
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path


class SourceUnavailable(RuntimeError):
    """The old source could not be read (no git, not a repository, unknown revision or path,
    missing file in the folder); the message says which and how to get it."""


def read_source(rev: str, path: str, src_dir: str | None = None) -> str:
    """The text of repository file ``path`` at ``rev``, or of ``src_dir/<basename of path>``.

    Raises:
        SourceUnavailable: see the class.
    """
    if src_dir is not None:
        f = Path(src_dir) / Path(path).name
        if not f.is_file():
            raise SourceUnavailable(f"{f} not found (extract it with: git show {rev}:{path} > {f})")
        return f.read_text()
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{path}"],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise SourceUnavailable(f"git is not installed: cannot read {path} at {rev} "
                                "(pass a folder of extracted files instead)") from exc
    if done.returncode != 0:
        raise SourceUnavailable(f"git show {rev}:{path} failed in {root} (no repository, or the "
                                f"commit or path is absent): {done.stderr.strip()}")
    return done.stdout


def load_module(rev: str, path: str, name: str, src_dir: str | None = None) -> types.ModuleType:
    """Execute ``path`` at ``rev`` (see :func:`read_source`) as module ``name`` (registered in
    ``sys.modules`` while it runs, for dataclasses; the current module of ``path`` is untouched).

    Raises:
        SourceUnavailable: see the class.
    """
    module = types.ModuleType(name)
    module.__file__ = f"{rev}:{path}"
    sys.modules[name] = module
    try:
        exec(compile(read_source(rev, path, src_dir), module.__file__, "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module
