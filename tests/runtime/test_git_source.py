"""runtime/bench/git_source.py: an old module version loaded at run time (the mirror bench's
'before'), from a folder of extracted files or from git, with a clear error when absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bench.git_source import SourceUnavailable, load_module, read_source

ROOT = Path(__file__).resolve().parents[2]


def test_module_from_a_folder_runs_under_its_own_name(tmp_path):
    (tmp_path / "old.py").write_text("import sys\nVALUE = 41 + 1\nNAME = __name__\n")
    m = load_module("abc123", "runtime/x/old.py", "_old_at_abc123", str(tmp_path))
    assert (m.VALUE, m.NAME, m.__file__) == (42, "_old_at_abc123", "abc123:runtime/x/old.py")
    assert sys.modules["_old_at_abc123"] is m


def test_missing_file_in_the_folder_says_how_to_extract_it(tmp_path):
    with pytest.raises(SourceUnavailable) as info:
        load_module("abc123", "runtime/worker/token_check.py", "_never", str(tmp_path))
    assert str(info.value) == (f"{tmp_path}/token_check.py not found (extract it with: git show "
                               f"abc123:runtime/worker/token_check.py > {tmp_path}/token_check.py)")
    assert "_never" not in sys.modules


def test_from_git_at_head_and_an_unknown_revision():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    head = read_source("HEAD", "runtime/bench/git_source.py")
    assert head.splitlines()[0] == ('"""An older version of a repository module, loaded at run '
                                    'time to benchmark against (no frozen')
    with pytest.raises(SourceUnavailable) as info:
        read_source("0" * 40, "runtime/bench/git_source.py")
    assert str(info.value).startswith(f"git show {'0' * 40}:runtime/bench/git_source.py failed")
