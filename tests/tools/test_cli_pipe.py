"""``tool | head``: a command-line tool whose stdout reader closes early exits quietly with 141
(``ppstate/cli_pipe.py``), for every entry point that prints a lot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppstate.cli_pipe import EXIT_BROKEN_PIPE, run_main

ROOT = Path(__file__).resolve().parents[2]


def _closed_reader_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python -m args`` with stdout a pipe whose reader is closed before it starts (the
    earliest a reader like ``head -c 0`` can go: every write fails, deterministically)."""
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run([sys.executable, "-m", *args], stdout=w, stderr=subprocess.PIPE,
                              cwd=cwd, env=env, timeout=120, text=True)
    finally:
        os.close(w)


@pytest.fixture(scope="module")
def sim_trace(tmp_path_factory) -> Path:
    from ppstate.sim.trace import record_sim
    from ppstate.sim.workload import SimConfig
    _, run_dir = record_sim(SimConfig(pp_size=2, num_requests=4, seed=1),
                            tmp_path_factory.mktemp("traces"))
    return run_dir


@pytest.mark.parametrize("args", [
    ["ppstate.replay", "{trace}"],
    ["ppstate.replay", "{trace}", "--json"],
    ["ppstate.sim", "--pp", "2", "--requests", "4"],
    ["ppstate.check", "--pp", "2", "--requests", "1", "--prompt-len", "1:1", "--max-tokens", "1:1"],
    ["ppstate.sim.lane_sweep", "--points", "1,2"],
], ids=["replay", "replay-json", "sim", "check", "lane_sweep"])
def test_closed_reader_exits_141_without_a_traceback(args, sim_trace, tmp_path):
    args = [a.format(trace=sim_trace) for a in args]
    proc = _closed_reader_run(args, tmp_path)
    assert (proc.returncode, proc.stderr) == (EXIT_BROKEN_PIPE, "")


def test_head_reads_one_line_and_the_rest_is_dropped_quietly(sim_trace, tmp_path):
    """A real ``| head -n 1`` through the shell: the first line arrives, no traceback."""
    cmd = (f"{sys.executable} -m ppstate.replay {sim_trace} --until 5 | head -n 1; "
           "echo status=${PIPESTATUS[0]}")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    first, status = proc.stdout.splitlines()
    assert first.startswith(f"run {sim_trace.name} (sim) at ")
    assert status in ("status=0", f"status={EXIT_BROKEN_PIPE}")   # head may close before or after
    assert proc.stderr == ""


def test_run_main_passes_the_status_and_reraises_other_broken_pipes():
    assert run_main(lambda: 3) == 3 and run_main(lambda: None) == 0

    def worker_pipe_broke():
        raise BrokenPipeError(32, "Broken pipe")   # not stdout: stdout here is pytest's capture
    with pytest.raises(BrokenPipeError):
        run_main(worker_pipe_broke)


@pytest.mark.parametrize("flag, name", [("--plot", "x.png"), ("--timeline", "t.json")])
def test_replay_output_in_a_missing_folder_is_refused_up_front(flag, name, tmp_path, capsys):
    """An output path whose folder does not exist is refused (exit 2, naming the flag and the
    folder) before the trace is read: no traceback after a whole replay."""
    from ppstate.replay import main as replay_main
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as exc:
        replay_main([str(tmp_path), flag, str(missing / name)])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.endswith(f"error: {flag}: the folder {missing} of {missing / name} does not exist\n")
