"""--api-server-count: the supervisor's error names which process ended and how."""

from types import SimpleNamespace

from runtime.server.api_servers import who_exited


def _proc(pid, exitcode):
    return SimpleNamespace(pid=pid, exitcode=exitcode, is_alive=lambda: exitcode is None)


def test_a_killed_api_server_is_named_with_its_signal():
    core = _proc(10, None)
    fronts = [_proc(11, -9), _proc(12, None)]
    assert who_exited(core, fronts) == "API server 0 (pid 11) exited: killed by SIGKILL"


def test_the_core_and_a_failed_api_server_are_both_named():
    assert who_exited(_proc(10, 1), [_proc(11, None), _proc(12, 3)]) == \
        "engine core (pid 10) exited: exit status 1; API server 1 (pid 12) exited: exit status 3"
