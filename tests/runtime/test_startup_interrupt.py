"""Ctrl-C while ``python -m runtime.serve`` / ``runtime.generate`` import (seconds: torch, FastAPI)
printed a KeyboardInterrupt traceback: now one line, ``interrupted``, and exit status 130
(runtime/interrupt.py); after start-up Ctrl-C raises KeyboardInterrupt again (not swallowed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import interrupt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sigint_restored():
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


def test_quiet_until_started_then_keyboard_interrupt_again(sigint_restored, capsys):
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.quiet_start()
    with pytest.raises(SystemExit) as exc:
        signal.raise_signal(signal.SIGINT)
    assert exc.value.code == 130 and capsys.readouterr().err == "interrupted\n"
    interrupt.started()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):   # not swallowed once main handles it
        signal.raise_signal(signal.SIGINT)


def test_an_ignored_or_own_sigint_handler_is_left_alone(sigint_restored):
    """A background job's ignored SIGINT stays ignored; main() called in-process (tests) does
    not replace a handler it did not install."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupt.quiet_start()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    interrupt.started()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _sigint_default() -> None:
    """In the child before exec: SIGINT at its default, as under a terminal. A test run started
    as a background job of a non-interactive shell (``cmd &``: CI scripts, nohup) inherits
    SIGINT ignored, which the command rightly leaves alone (test above)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:   # exited already
        return True


def _asyncio_is_a_shared_library() -> bool:
    import _asyncio
    return bool(getattr(_asyncio, "__file__", None))


@pytest.mark.skipif(not Path("/proc/self/maps").exists() or not _asyncio_is_a_shared_library(),
                    reason="needs asyncio's C module as a shared library and /proc (Linux)")
@pytest.mark.parametrize("module, flags", [
    ("runtime.serve", ["--port", "0"]),
    ("runtime.generate", ["--prompt", "Hello", "--max-tokens", "1"]),
])
def test_ctrl_c_during_the_start_up_imports(module, flags):
    """SIGINT once the process has loaded asyncio's C module: the module's own ``import
    asyncio`` (site and runpy load no asyncio), which follows the handler and precedes seconds of
    other imports, so the signal lands in them however loaded the machine is."""
    proc = subprocess.Popen([sys.executable, "-m", module, *flags], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 60
        while not _loaded(proc.pid, "_asyncio") and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, out, err) == (130, "", "interrupted\n")
