"""``python -m runtime.serve`` as a subprocess on a tiny random-weight model, for HTTP-path tests.

:func:`tiny_model_folder` saves the CPU-sized ``tiny`` Llama shape of ``runtime.bench.gpu_models``
(4 layers, hidden 64, a 512-token word-level vocabulary) as an HF folder (without transformers): the server starts in a
few seconds and serves it by token ids. :class:`TinyServer` starts the server on port 0, reads the
URL from its ``ready:`` line and keeps every stdout line (``lines``) for the test to inspect.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 180


def tiny_model_folder(path: Path) -> Path:
    """Write the ``tiny`` random-weight Llama (float32) with its word-level tokenizer to ``path``."""
    from runtime.bench.model_folder import write_random_folder
    return write_random_folder("tiny", path, "float32", "word")


class TinyServer:
    """The real server process; ``url`` once :meth:`wait_ready` returned."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ppstate-serve-", suffix=".log")  # noqa: SIM115
        cmd = [sys.executable, "-m", "runtime.serve", "--port", "0", "--model", str(model),
               "--pp", "1", "--device", "cpu", "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ready: "):
                self.ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> str:
        """The server's base URL once it printed ``ready:``.

        Raises:
            RuntimeError: not ready within ``timeout`` seconds (the log tail is in the message).
        """
        if not self.ready.wait(timeout):
            self.stop()
            raise RuntimeError(f"server not ready in {timeout} s: {''.join(self.lines)}\n{self.stderr()}")
        line = next(x for x in self.lines if x.startswith("ready: "))
        self.url = re.match(r"ready: (http://\S+)", line).group(1)
        return self.url

    def stderr(self) -> str:
        """The last 3000 characters the server wrote to stderr."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-3000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server process."""
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGINT (if still running), wait, kill on timeout; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode
