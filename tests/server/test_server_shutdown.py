"""The real server process (issue #12 items 5 and the /health-while-loading bug): ``/health`` is
503 ``loading`` before the model is up; SIGTERM with a stream open ends the stream with an error
event naming the shutdown and ``[DONE]``, exits 0, and leaves no worker process and no ipc socket
file behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def bound_ipc_paths(pid: int) -> set[str]:
    """Paths of the unix sockets process ``pid`` holds (its zmq ipc endpoints)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and "ppstate-" in parts[7]:
            paths.add(parts[7])
    return paths


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_loading_health_then_sigterm_with_open_stream():
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.serve", "--port", "0", "--pp", "2", "--max-model-len", "64",
         "--max-num-seqs", "4"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        first = proc.stdout.readline()
        assert first.startswith("loading model") and "/health answers 503" in first
        url = first.split(" stage(s) (")[1].split("; ")[1].split("/health")[0]
        r = httpx.get(f"{url}/health", timeout=60)       # the model is still loading
        assert r.status_code == 503 and r.json()["status"] == "loading"
        line = proc.stdout.readline()
        while not line.startswith("ready: "):
            assert line, "the server exited before ready"
            line = proc.stdout.readline()
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        workers = children(proc.pid)
        ipc = bound_ipc_paths(proc.pid)
        assert len([w for w in workers if alive(w)]) >= 2 and len(ipc) == 3  # results + 2 step sockets
        events: list[str] = []
        two = threading.Event()

        def read_stream() -> None:
            body = {"model": "default", "prompt": "1 2 3", "max_tokens": 40, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                events.append(str(resp.status_code))
                for ln in resp.iter_lines():
                    if ln.startswith("data: "):
                        events.append(ln[len("data: "):])
                        if len(events) == 3:
                            two.set()
            two.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert two.wait(120)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "shutting down: ending open streams" in proc.stdout.read()   # says why it stops
        reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[0] == "200" and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "server_shutting_down" and "shutting down" in err["message"], err
    assert 2 <= len(events) - 3 < 40                   # tokens came, the request did not finish
    # no orphan: multiprocessing's resource tracker (a child of the server) exits on its own once
    # the server's end of its pipe closes, a moment after the server; give it up to 10 s
    for _ in range(100):
        if not [w for w in workers if alive(w)]:
            break
        time.sleep(0.1)
    assert [w for w in workers if alive(w)] == []
    assert all(not os.path.exists(p) for p in ipc)     # no leaked socket files
    assert not os.path.exists(os.path.dirname(next(iter(ipc))))
