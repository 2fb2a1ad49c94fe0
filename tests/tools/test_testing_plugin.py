"""ppstate's pytest plugin (runtime.testing.plugin) and ppstate.testing: the README example run
with pytester in a folder of its own (no conftest, no ini file), mutants caught by
assert_invariants with invariant and step named, the failure report's trace path, and
pp_engine's teardown after a test that raises mid-stream (run in the same pytest subprocess as
the example: one interpreter start for both)."""

from __future__ import annotations

import re
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import psutil
import pytest

from ppstate.sim import rank as sim_rank
from ppstate.budget import SchedulerConfig
from ppstate.testing import InvariantViolation, assert_invariants, explain, replay

pytest_plugins = ("pytester",)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "test_with_ppstate.py"
# Installed packages load the plugin through the pytest11 entry point; a checkout used through
# PYTHONPATH names it (naming it as well as the entry point would register it twice).
PLUGIN_ARGS = ([] if any(ep.value == "runtime.testing.plugin"
                         for ep in entry_points(group="pytest11"))
               else ["-p", "runtime.testing.plugin"])


def test_readme_example_is_the_example_file():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Testing your own PP configuration"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert block == EXAMPLE.read_text(encoding="utf-8")


def _chunked_abort_run(pipe):
    pipe.add_request("long", 20, max_tokens=6)
    pipe.add_request("short", 4, max_tokens=5)
    while len(pipe.tokens("long")) < 2:
        pipe.step()
    assert pipe.abort("long")
    return pipe.run_until_done()


def test_sim_pipeline_abort_mid_decode_and_chunked_prefill(sim_pipeline, tmp_path):
    pipe = sim_pipeline(pp_size=2, max_prefill_chunk=8, seed=5)
    _chunked_abort_run(pipe)
    assert pipe.finish_reason("long") == "abort" and pipe.finish_reason("short") == "length"
    got = pipe.tokens("long")
    assert 2 <= len(got) < 6 and got == pipe.expected_tokens("long")[:len(got)]
    assert pipe.tokens("short") == pipe.expected_tokens("short") and len(pipe.tokens("short")) == 5
    assert [e["req_id"] for e in pipe.events("abort")] == ["long"]
    assert_invariants(pipe)
    run_dir = pipe.write_trace(tmp_path)
    assert replay(run_dir).ok
    prefill = [(e["start"], e["num_scheduled_tokens"], e["final_chunk"]) for e in explain(run_dir, "long")
               if e["what"] == "scheduled" and e["start"] < 20]
    assert prefill == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_cadence_mutant_fails_naming_invariant_5_and_step(sim_pipeline, monkeypatch, tmp_path):
    monkeypatch.setattr(SchedulerConfig, "cadence", property(lambda self: 1))  # planted bug
    pipe = sim_pipeline(pp_size=2, max_prefill_chunk=8, seed=3)
    pipe.add_request("a", 4, max_tokens=6)
    pipe.run_until_done()
    first = {"invariant": 5, "step": 1, "rank": None, "slot": 0, "req_id": "a",
             "message": "request a decodes at step 1, 1 steps after step 0 (< 2)"}
    with pytest.raises(InvariantViolation) as live:
        assert_invariants(pipe)
    assert live.value.violation == first
    assert ("invariant 5 (cadence) violated at step 1 slot 0 request a: request a decodes"
            in str(live.value))
    with pytest.raises(InvariantViolation) as recorded:  # the same run, replayed from its trace
        assert_invariants(pipe.write_trace(tmp_path))
    assert recorded.value.violation == first


def test_rank_local_broadcast_mutant_fails_naming_invariant_1_and_step(sim_pipeline, monkeypatch):
    # planted bug: the last rank decides to broadcast from "rows exist", not "a row needs its
    # sample", so it sends for a step of only a non-final chunk while rank 0 does not receive
    publish = sim_rank.SimRank.publish
    monkeypatch.setattr(sim_rank.SimRank, "publish", lambda self, out, mask, payload: publish(
        self, out, np.ones(out.num_rows, dtype=bool) if out.num_rows else None, payload))
    pipe = sim_pipeline(pp_size=2, max_prefill_chunk=8, seed=3)
    pipe.add_request("a", 20, max_tokens=2)
    pipe.run_until_done()
    want = (r"invariant 1 \(collective matching\) violated at step 0: broadcast posted by "
            r"ranks \[1\] only")
    with pytest.raises(InvariantViolation, match=want):
        assert_invariants(pipe)


def test_failing_test_report_names_its_trace(pytester, tmp_path):
    pytester.makepyfile(test_fails="""
        def test_fails(sim_pipeline):
            pipe = sim_pipeline(pp_size=2, seed=1)
            pipe.add_request("a", 6, max_tokens=3)
            pipe.step(2)
            assert pipe.tokens("a") == [0]
    """)
    res = pytester.runpytest(*PLUGIN_ARGS, "--ppstate-trace-dir", str(tmp_path))
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*ppstate traces*",
                              f"trace: {tmp_path}/*test_fails.py_test_fails/run-*"])
    path = re.search(r"trace: (\S+)", res.stdout.str()).group(1)
    res = replay(path)  # what the test ran before failing: the first round's window of pp_size + 1
    assert res.steps == 2 and res.first_divergence is None   # numbers: steps 0, 2 (1 skipped)
    assert [v["invariant"] for v in res.invariant_violations] == [6]  # "a" never finished


RAISES = """
    import os
    import pytest
    from runtime.sampling_params import SamplingParams

    @pytest.mark.asyncio
    async def test_raises_mid_stream(pp_engine):
        engine = await pp_engine(pp_size=2, max_model_len=64, max_num_seqs=2)
        with open(os.environ["PPSTATE_TEST_PIDS"], "w") as fh:
            fh.write(" ".join(str(p.pid) for p in engine.pool.procs))
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        async for out in engine.add_request("r", [504, 3575, 282], params):
            if out.new_token_ids:
                raise RuntimeError("boom mid-stream")
"""


@pytest.mark.slow
def test_readme_example_passes_and_pp_engine_teardown_after_raise_leaves_no_process(
        pytester, tmp_path, monkeypatch):
    """The README example, copied as is into pytester's empty folder, passes both its tests;
    next to it, a test that raises mid-stream fails with its own error and its engine's
    teardown leaves no worker process."""
    shutil.copy(EXAMPLE, pytester.path / EXAMPLE.name)
    pids_file = tmp_path / "pids"
    monkeypatch.setenv("PPSTATE_TEST_PIDS", str(pids_file))
    pytester.makepyfile(test_raises=RAISES)
    res = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider", "-rA")
    res.assert_outcomes(passed=2, failed=1)
    res.stdout.fnmatch_lines_random([
        f"PASSED {EXAMPLE.name}::test_abort_mid_decode_frees_the_slot",
        f"PASSED {EXAMPLE.name}::test_chunked_prefill_gives_the_unchunked_tokens",
        "FAILED test_raises.py::test_raises_mid_stream*"])
    # the test's own error; teardown raised nothing (it errors when a worker is left alive, see
    # runtime.testing.plugin; daemon workers would also die with the pytest process, so the
    # fixture's own check is what catches a teardown that forgot an engine)
    res.stdout.fnmatch_lines(["*RuntimeError: boom mid-stream*", "*ppstate traces*"])
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 2
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
