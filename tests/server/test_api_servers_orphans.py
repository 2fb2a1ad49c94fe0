"""--api-server-count: the engine core and the API servers (each in its own process group) end
when their supervisor is SIGKILLed; they were left running, the API servers holding the port."""

import subprocess
import sys
import textwrap

from runtime.engine.rank_process import EXIT_ENGINE_GONE


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_core_main_exits_when_its_supervisor_is_already_gone():
    """The core's watch starts after its imports: a supervisor killed meanwhile is caught too
    (the pid is passed in; the child's getppid() would be init's by then)."""
    pid = _dead_pid()
    res = _run(f"""
        from runtime.server.engine_core import core_main
        core_main(None, "ipc:///nonexistent-in", [], supervisor_pid={pid})
    """)
    assert res.returncode == EXIT_ENGINE_GONE, res.stderr
    assert res.stderr.endswith(f": supervisor {pid} is gone; exiting\n")
    assert res.stderr.startswith("engine core ")


def test_watch_names_both_processes():
    pid = _dead_pid()
    res = _run(f"""
        import time
        from runtime.engine.rank_process import watch_engine
        watch_engine({pid}, who="API server 1", watched="supervisor")
        time.sleep(30)
    """)
    assert res.returncode == EXIT_ENGINE_GONE
    assert res.stderr.startswith("API server 1 ") and \
        res.stderr.endswith(f": supervisor {pid} is gone; exiting\n")
