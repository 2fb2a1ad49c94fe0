"""A simulator run that finds a violation says which, where, and how to see it again: the text
report lists each violation, the printed command is the user's own (re-running it reports the
same violations) and the trace it writes replays to ``ok=False`` with those violations listed
(the simulated ranks are not in the trace; the simulator's findings are, in its header)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ppstate.replay import main as replay_main
from ppstate.replay.replayer import replay
from ppstate.sim.cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["--pp", "2", "--requests", "4", "--seed", "0", "--spec-tokens", "2",
        "--spec-acceptance", "0.5", "--mutant", "keep_rejected_draft"]
SUMMARY = ("steps=28 ticks=563 completed=4 aborted=0 output_tokens=76 throughput=0.1350 tok/tick "
           "bubble=0.194 preemptions=0 prefix_hit_tokens=0 violations=72")
FIRST = {"invariant": 8, "step": 2, "rank": 0, "slot": 0, "req_id": "req-0",
         "message": "req-0: 32 KV positions computed after step 2, accepted tokens cover 30"}
FIRST_LINE = ("invariant 8 (KV completeness) violated at step 2 rank 0 slot 0 request req-0: "
              "req-0: 32 KV positions computed after step 2, accepted tokens cover 30")


def _sim(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    rc = run_cli(argv)
    out = capsys.readouterr()
    return rc, out.out.splitlines(), out.err.splitlines()


def test_text_report_lists_each_violation_and_repeats_the_users_flags(monkeypatch, tmp_path,
                                                                        capsys):
    rc, out, err = _sim(ARGV, monkeypatch, tmp_path, capsys)
    assert rc == 1 and out[0] == SUMMARY and out[1] == FIRST_LINE
    assert len(out) == 1 + 50 + 1 and out[-1] == "... 22 more (the first 50 are kept)"
    assert all(line.startswith("invariant ") for line in out[1:51])
    trace = next(Path(line.split()[3]) for line in err if line.startswith("trace written to "))
    assert trace.parent == Path("sim-traces")
    assert err[-2:] == ["invariant violations with seed 0; reproduce with:",
                        "  python -m ppstate.sim " + shlex.join(ARGV)]   # no --json added


def test_json_run_repeats_json(monkeypatch, tmp_path, capsys):
    rc, out, err = _sim(ARGV + ["--json"], monkeypatch, tmp_path, capsys)
    report = json.loads(out[0])
    assert rc == 1 and report["invariant_violations"][0] == FIRST
    assert report["num_violations"] == 72 and len(out) == 1
    assert err[-1] == "  python -m ppstate.sim " + shlex.join(ARGV + ["--json"])


def test_printed_command_reproduces_and_the_trace_replays_the_violation(monkeypatch, tmp_path,
                                                                          capsys):
    rc, out, err = _sim(ARGV, monkeypatch, tmp_path, capsys)
    command = shlex.split(err[-1])
    assert rc == 1 and command[:3] == ["python", "-m", "ppstate.sim"]
    again = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert again.returncode == 1 and again.stdout.splitlines() == out   # same violations
    assert again.stdout.splitlines()[1] == FIRST_LINE

    trace = next(line.split()[3] for line in err if line.startswith("trace written to "))
    assert replay_main([trace]) == 1
    text = capsys.readouterr().out.splitlines()
    assert text[1:4] == [
        "ok=False steps=28 events=100 rank_steps={}",
        "checked: scheduler decisions (engine.jsonl) only: the simulated ranks are not "
        "recorded; the violations the simulator found are listed as recorded",
        "recorded by the simulator: 72 invariant violations (the first 50 kept), 0 of them also "
        "found by replay:"]
    assert text[4] == "  recorded: " + FIRST_LINE
    assert text[-1] == "re-run the simulator (its ranks) with: " + err[-1].strip()

    res = replay(trace)
    assert (res.ok, res.first_divergence, res.invariant_violations) == (False, None, [])
    assert res.recorded_violations[0] == {**FIRST, "refound": False}
    assert (len(res.recorded_violations), res.num_recorded_violations) == (50, 72)
    assert res.repro == err[-1].strip()
    assert replay_main([trace, "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["recorded_violations"][0] == {**FIRST, "refound": False} and d["ok"] is False


def test_clean_sim_trace_replays_ok_and_says_what_it_checked(monkeypatch, tmp_path, capsys):
    rc, out, _ = _sim(["--pp", "2", "--requests", "4", "--trace-dir", "tr"], monkeypatch,
                      tmp_path, capsys)
    assert rc == 0 and len(out) == 1 and out[0].endswith(" violations=0")
    res = replay("tr")
    assert res.ok and res.recorded_violations == [] and res.num_recorded_violations == 0
    assert res.repro == "python -m ppstate.sim --pp 2 --requests 4 --trace-dir tr"
    assert res.checked == ("scheduler decisions (engine.jsonl) only: the simulated ranks are not "
                           "recorded; the violations the simulator found are listed as recorded")


def _assert_refused(run_cli, argv, want: str, capsys) -> None:
    """``python -m ppstate.sim ARGV`` exits 2 before printing anything, its error ending ``want``."""
    with pytest.raises(SystemExit) as exc:
        run_cli(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert out.err.endswith(f"python -m ppstate.sim: error: {want}\n")


@pytest.mark.parametrize("argv, want", [
    (["--mutant", "blocking_all_chunk_broadcast"],
     "argument --mutant: blocking_all_chunk_broadcast is not simulated (a rank waiting at once for "
     "the broadcast of the step it is computing is not modelled by the simulator's tick schedule); "
     "run the model checker: python -m ppstate.check --mutant blocking_all_chunk_broadcast"),
    (["--mutant", "grammar_on_rejected", "--spec-tokens", "2"],
     "argument --mutant: grammar_on_rejected is not simulated (the simulator runs no grammar "
     "(structured output)); run the model checker: python -m ppstate.check --mutant "
     "grammar_on_rejected"),
    (["--mutant", "keep_rejected_draft"],
     "argument --mutant: keep_rejected_draft breaks speculative decoding only; add --spec-tokens K "
     "(K >= 1), e.g. --spec-tokens 2"),
])
def test_mutants_the_simulator_cannot_run_are_refused(argv, want, capsys):
    """A mutant the simulator does not model (it crashed, or ran as a silent no-op) is refused
    with exit 2 before anything runs, naming the flag and where to run it instead."""
    from ppstate.sim.cli import run_cli
    _assert_refused(run_cli, argv, want, capsys)


@pytest.mark.parametrize("argv, want", [
    (["--contention", "0.5"],
     "argument --contention: must be >= 1 (a slow-down: 1 = none), got 0.5"),
    (["--contention", "inf"], "argument --contention: must be finite, got inf"),
    (["--spec-tokens", "99"],
     "argument --spec-tokens: must be in [0, 16] (the engine's --spec-tokens bound), got 99"),
    (["--spec-tokens", "-1"],
     "argument --spec-tokens: must be in [0, 16] (the engine's --spec-tokens bound), got -1"),
])
def test_out_of_range_flags_are_refused_naming_the_flag(argv, want, capsys):
    """--contention below 1 was refused naming the model's field (StepCostModel.concurrency),
    --spec-tokens beyond the engine's bound was run: both now exit 2 naming the flag and range."""
    from ppstate.sim.cli import run_cli
    from runtime.config import SCHEDULER_BOUNDS
    assert SCHEDULER_BOUNDS["num_spec_tokens"] == (0, 16)   # the engine's bound, the same
    _assert_refused(run_cli, argv, want, capsys)


@pytest.mark.parametrize("argv, want", [
    (["--contention", "0.5"], "argument --contention: must be >= 1, got 0.5"),
    (["--contention", "nan"], "argument --contention: must be >= 1, got nan"),
    (["--contention", "inf"], "argument --contention: must be finite, got inf"),
    (["--policy-contention", "0"], "argument --policy-contention: must be >= 1, got 0"),
    (["--pp", "1"], "argument --pp: must be >= 2, got 1"),
    (["--points", "4,0"], "argument --points: must be >= 1, got 0"),
    (["--empty", "-1"], "argument --empty: must be >= 0, got -1"),
])
def test_lane_sweep_names_the_flag_out_of_range(argv, want, capsys):
    """lane_sweep listed every bound in one message whichever flag was wrong, and let
    --contention nan through to a SchedulerError traceback: it now names the one flag (exit 2)."""
    from ppstate.sim.lane_sweep import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert out.err.endswith(f"python -m ppstate.sim.lane_sweep: error: {want}\n")


@pytest.mark.parametrize("argv, want", [
    (["--abort-rate", "2"], "argument --abort-rate: must be in [0, 1], got 2"),
    (["--abort-rate", "inf"], "argument --abort-rate: must be in [0, 1], got inf"),
    (["--eos-prob", "nan"], "argument --eos-prob: must be in [0, 1], got nan"),
    (["--fork-rate", "5"], "argument --fork-rate: must be in [0, 1], got 5"),
    (["--spec-acceptance", "1.5"], "argument --spec-acceptance: must be in [0, 1], got 1.5"),
    (["--eos-prob", "x"], "argument --eos-prob: expected a number, got 'x'"),
    (["--prompt-len", "5:1"], "argument --prompt-len: must be A:B with 1 <= A <= B, got 5:1"),
    (["--output-len", "0:3"], "argument --output-len: must be A:B with 1 <= A <= B, got 0:3"),
    (["--stage-cost=-1:0"],
     "argument --stage-cost: must be BASE:PER_TOKEN with both >= 0, not both 0, got -1:0"),
    (["--stage-cost", "0:0"],
     "argument --stage-cost: must be BASE:PER_TOKEN with both >= 0, not both 0, got 0:0"),
    (["--shared-prefix", "-3"], "argument --shared-prefix: must be >= 0, got -3"),
    (["--shared-prefix", "2048"],
     "argument --shared-prefix: must be < --max-model-len (2048): a prompt is the prefix and "
     "at least 1 token more, got 2048"),
    (["--p2p-ticks", "-1"], "argument --p2p-ticks: must be >= 0, got -1"),
    (["--broadcast-ticks", "-2"], "argument --broadcast-ticks: must be >= 0, got -2"),
    (["--empty-step-ticks", "-5"],
     "argument --empty-step-ticks: must be >= -1 (-1: the stage's base cost), got -5"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--spec-acceptance", "0.5"], "argument --spec-acceptance: has no effect without "
     "speculative decoding; add --spec-tokens K (K >= 1)"),
])
def test_sim_config_ranges_are_refused_naming_the_flag(argv, want, capsys):
    """These flags were refused naming the SimConfig (or SchedulerConfig) field instead of the
    flag, --shared-prefix -3 ran as 0, --seed -1 ended in numpy's ValueError traceback and a
    --shared-prefix beyond the model length tried to allocate the prefix (MemoryError): each now
    exits 2 before running, naming the flag and its range."""
    from ppstate.sim.cli import run_cli
    _assert_refused(run_cli, argv, want, capsys)


@pytest.mark.parametrize("argv, want", [
    (["--seeds", "0"], "argument --seeds: must be >= 1, got 0"),
    (["--start", "-1"], "argument --start: must be >= 0, got -1"),
    (["--jobs", "0"], "argument --jobs: must be >= 1, got 0"),
])
def test_soak_names_the_one_flag_out_of_range(argv, want, capsys):
    """--seeds 0 and --start -1 both got one message naming both flags: each names its own."""
    from ppstate.sim.soak import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert out.err.endswith(f"python -m ppstate.sim.soak: error: {want}\n")
