"""Record a real PP=2 run (real model, 12 requests, 3 aborts) with --trace-dir and replay it
without the model: every decision equal, invariants hold; tampered copies diverge at the right
step and rank; the timeline is valid trace-event JSON and the Gantt PNG is written; a simulator
run with a planted bug writes its trace and replay reports the same violations."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ppstate.replay import main as replay_main
from ppstate.replay.replayer import ReplayFailure, replay
from ppstate.trace.run import find_run_dir, load_run
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from engine_harness import EngineThread

NUM, ABORTED = 12, (2, 5, 9)


def _prompts() -> list[list[int]]:
    rng = random.Random(9)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(NUM)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(run directory, client results) of a PP=2 run with 3 aborted requests."""
    base = tmp_path_factory.mktemp("traces")
    eng = EngineThread(EngineConfig(pp_size=2, max_num_seqs=8, max_model_len=128,
                                    max_prefill_chunk=16, max_num_batched_tokens=32,
                                    step_timeout_s=60.0, trace_dir=str(base)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        async def go():
            return await asyncio.gather(*(
                eng.collect(f"r{i}", p, params, abort_after=2 if i in ABORTED else None)
                for i, p in enumerate(_prompts())))
        results = eng.run(go())
    finally:
        eng.close()
    return find_run_dir(base), results


pytestmark = pytest.mark.slow


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / run_dir.name
    shutil.copytree(run_dir, dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(e) + "\n" for e in edit(lines)))


def test_replay_of_real_run_is_ok(recorded):
    run_dir, results = recorded
    res = replay(run_dir)
    assert res.first_divergence is None and res.invariant_violations == [] and res.ok
    run = load_run(run_dir)
    steps = [e["step"] for e in run.engine if e["kind"] == "schedule"]
    assert res.steps == len(steps) == steps[-1] + 1
    assert res.rank_steps == {0: res.steps, 1: res.steps}
    assert sum(e["kind"] == "arrival" for e in run.engine) == NUM
    aborted = {e["req_id"] for e in run.engine
               if e["kind"] == "lifecycle" and e["trigger"] == "abort"}
    assert aborted == {f"r{i}" for i in ABORTED}
    # what the trace says each client got is what each client got
    got: dict[str, list[int]] = {}
    for e in run.engine:
        if e["kind"] == "tokens":
            for u in e["updates"]:
                got.setdefault(u["req_id"], []).extend(u["token_ids"])
    for i, r in enumerate(results):
        assert got.get(f"r{i}", [])[:len(r["token_ids"])] == r["token_ids"]
        assert r["finish_reason"] == ("abort" if i in ABORTED else "length")
    assert all(e.get("prompt_token_ids") is None for e in run.engine if e["kind"] == "arrival")
    assert not list(run.path.parent.glob("*.jsonl"))  # everything inside the run directory


def test_a_finished_run_ends_with_nothing_in_flight(recorded):
    """The engine's last step only delivers freed slots; the engine shut down without reading
    its result, so a finished run's trace ended with that step in flight (``--until 999``:
    ``"in_flight": 1``) although its ranks had recorded running it. A shutdown with no live
    request now waits for the steps in flight: every issued step has its result."""
    run_dir, _ = recorded
    run = load_run(run_dir)
    issued = [e["step"] for e in run.engine if e["kind"] == "schedule"]
    answered = [e["of_step"] for e in run.engine if e["kind"] == "result"]
    assert sorted(answered) == issued
    state = replay(run_dir, until=issued[-1] + 1).state
    assert (state["last_step"], state["in_flight"], state["running"]) == (issued[-1], 0, {})


def _first(events, pred):
    return next(i for i, e in enumerate(events) if pred(e))


def test_tampered_sampled_id_diverges_on_last_rank(recorded, tmp_path):
    run_dir = _copy(recorded[0], tmp_path)
    run = load_run(run_dir)
    i = _first(run.ranks[1],
               lambda e: e["kind"] == "sampled" and 1 in e["num_sampled"] and e["step"] > 3)
    step, row = run.ranks[1][i]["step"], run.ranks[1][i]["num_sampled"].index(1)

    def edit(lines):
        lines[i]["token_ids"][row][0] += 1
        return lines
    _rewrite(run_dir / "rank1.jsonl", edit)
    d = replay(run_dir).first_divergence
    assert (d["step"], d["rank"], d["kind"]) == (step, 1, "sampled")
    assert d["recorded"]["token_ids"][row][0] == d["replayed"]["token_ids"][row][0] + 1


def test_dropped_free_diverges_on_that_rank(recorded, tmp_path):
    run_dir = _copy(recorded[0], tmp_path)
    run = load_run(run_dir)
    i = _first(run.ranks[0], lambda e: e["kind"] == "pp.free")
    step = run.ranks[0][i]["step"]
    _rewrite(run_dir / "rank0.jsonl", lambda lines: lines[:i] + lines[i + 1:])
    res = replay(run_dir)
    d = res.first_divergence
    assert not res.ok and (d["step"], d["rank"], d["kind"]) == (step, 0, "pp.free")
    with pytest.raises(ReplayFailure, match=f"step {step} rank 0"):
        res.assert_ok()


def test_swapped_rows_diverge_in_the_scheduler(recorded, tmp_path):
    run_dir = _copy(recorded[0], tmp_path)
    run = load_run(run_dir)
    i = _first(run.engine, lambda e: e["kind"] == "schedule" and e["step"] > 2
               and len(set(e["output"]["req_ids"])) >= 2)
    step = run.engine[i]["step"]

    def edit(lines):
        out = lines[i]["output"]
        for k in ("req_ids", "slots", "num_scheduled_tokens", "start_positions", "is_final_chunk"):
            out[k][0], out[k][1] = out[k][1], out[k][0]
        return lines
    _rewrite(run_dir / "engine.jsonl", edit)
    d = replay(run_dir).first_divergence
    assert (d["step"], d["rank"], d["kind"]) == (step, None, "schedule")
    assert d["recorded"]["output"]["req_ids"][:2] == d["replayed"]["output"]["req_ids"][1::-1]
    assert d["context"] and d["context"][-1] == run.engine[i - 1]


def test_cli_timeline_plot_explain(recorded, tmp_path, capsys):
    run_dir = recorded[0]
    tl, png = tmp_path / "t.json", tmp_path / "g.png"
    rc = replay_main([str(run_dir.parent), "--json", "--timeline", str(tl), "--plot", str(png),
                      "--explain", "r2"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["first_divergence"] is None
    events = json.loads(tl.read_text())["traceEvents"]
    assert all({"name", "ph", "ts", "pid", "tid"} <= e.keys() for e in events)
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"forward", "send", "recv", "broadcast", "sample"} <= names
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 0.0 <= out["bubble_fraction"] < 1.0
    whats = [e["what"] for e in out["explain"]]
    assert whats[0] == "arrival" and "admitted" in whats and "scheduled" in whats
    assert whats[-1] in ("slot freed", "deferred consume") and "abort" in whats
    rc = replay_main([str(run_dir), "--until", "3", "--json"])
    state = json.loads(capsys.readouterr().out)["state"]
    assert rc == 0 and state["next_step"] == 4


def test_sim_violation_trace_replays_the_violation(tmp_path, monkeypatch, capsys):
    from ppstate.budget import SchedulerConfig
    from ppstate.sim.cli import run_cli
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as m:  # planted bug: decode cadence 1 instead of pp_size
        m.setattr(SchedulerConfig, "cadence", property(lambda self: 1))
        rc = run_cli(["--pp", "2", "--requests", "4", "--seed", "3", "--output-len", "3:5",
                      "--json"])
    sim = json.loads(capsys.readouterr().out)
    assert rc == 1 and Path(sim["trace"]).parent == Path("sim-traces")
    assert (tmp_path / sim["trace"] / "engine.jsonl").is_file()
    res = replay(sim["trace"])
    assert not res.ok and res.first_divergence is not None
    want = {(v["invariant"], v["step"]) for v in sim["invariant_violations"] if v["invariant"] == 5}
    got = {(v["invariant"], v["step"]) for v in res.invariant_violations if v["invariant"] == 5}
    assert want and got == want
    assert res.first_divergence["step"] <= min(s for _, s in want)
    # the simulator's findings are in the trace; the scheduler-side ones replay found again
    assert res.recorded_violations == [{**v, "refound": v["invariant"] == 5}
                                       for v in sim["invariant_violations"]]


def test_cli_explain_of_an_unknown_request_is_refused(tmp_path, capsys):
    """--explain with an id that never arrived: exit 2 naming the flag and the run's ids (it
    exited 0 printing "not in this trace")."""
    from ppstate.sim.trace import record_sim
    from ppstate.sim.workload import SimConfig
    _, run_dir = record_sim(SimConfig(pp_size=2, num_requests=3, seed=1), tmp_path)
    ids = [e["req_id"] for e in load_run(run_dir).engine if e["kind"] == "arrival"]
    with pytest.raises(SystemExit) as exc:
        replay_main([str(run_dir), "--explain", "UNKNOWN"])
    assert exc.value.code == 2 and len(ids) == 3
    assert capsys.readouterr().err.endswith(
        f"error: --explain: request 'UNKNOWN' is not in this run; its requests: {', '.join(ids)}\n")
    assert replay_main([str(run_dir), "--explain", ids[1], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["explain"][0]["what"] == "arrival"


def test_prefix_cache_hits_replay_without_prompt_ids(tmp_path):
    """Prompts are not recorded (no --trace-prompts), yet prefix-cache hits depend on them: the
    arrival carries the chained block hashes, and replay rebuilds stand-in prompts with the same
    block equalities, so every hit and every block-table delta replays exactly."""
    from ppstate.sim.trace import record_sim
    from ppstate.sim.workload import SimConfig
    from ppstate.trace.run import load_run

    cfg = SimConfig(pp_size=2, num_requests=12, seed=3, shared_prefix=48, block_size=16)
    result, run_dir = record_sim(cfg, tmp_path)
    assert result.num_violations == 0 and result.prefix_hit_tokens >= 48
    run = load_run(run_dir)
    arrivals = [e for e in run.engine if e["kind"] == "arrival"]
    assert all(e["prompt_token_ids"] is None and len(e["prefix_hashes"]) >= 3 for e in arrivals)
    cached = [n["num_cached_tokens"] for e in run.engine if e["kind"] == "schedule"
              for n in e["output"]["new_requests"]]
    assert max(cached) >= 48  # some request did hit the shared prefix
    res = replay(run_dir)
    assert res.ok and res.first_divergence is None, res.first_divergence


def test_dropped_mirror_check_is_reported_by_the_cli_not_a_crash(recorded, tmp_path, capsys):
    """The replayed ``mirror.check`` holds fields replay cannot know (the ``ANY`` marker): the CLI
    still prints the divergence, as text and as JSON, and exits 1."""
    run_dir = _copy(recorded[0], tmp_path)
    run = load_run(run_dir)
    i = _first(run.ranks[0], lambda e: e["kind"] == "mirror.check" and e["step"] >= 3)
    step = run.ranks[0][i]["step"]
    _rewrite(run_dir / "rank0.jsonl", lambda lines: lines[:i] + lines[i + 1:])
    assert replay_main([str(run_dir)]) == 1
    assert f"step {step}" in capsys.readouterr().out
    assert replay_main([str(run_dir), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (d["step"], d["rank"], d["replayed"]["kind"]) == (step, 0, "mirror.check")


REPETITIVE = [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216] * 3 + [33, 28, 216]


def _record_spec(base: Path, prompts: bool) -> Path:
    """Run directory of one PP=2 run with --spec-tokens 2 and the n-gram probe (3), recorded
    under ``base`` with or without prompt ids."""
    eng = EngineThread(EngineConfig(pp_size=2, max_num_seqs=4, max_model_len=128,
                                    max_prefill_chunk=32, max_num_batched_tokens=64,
                                    num_spec_tokens=2, step_timeout_s=60.0,
                                    trace_dir=str(base), trace_prompts=prompts))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        async def go():
            await asyncio.gather(eng.collect("rep", REPETITIVE, params),
                                 eng.collect("ord", [504, 3575, 282, 4649, 314], params))
        eng.run(go())
    finally:
        eng.close()
    return find_run_dir(base)


@pytest.fixture(scope="module")
def spec_recorded(tmp_path_factory):
    """{trace_prompts: run directory} of two PP=2 runs with --spec-tokens 2 and the engine's
    n-gram probe (3), one recorded without prompt ids and one with them. The two engines (each
    with its own event loop, worker processes and trace directory) start and run side by side:
    their starts overlap (CI time)."""
    with ThreadPoolExecutor(2) as pool:
        runs = {prompts: pool.submit(_record_spec,
                                     tmp_path_factory.mktemp(f"spec-prompts-{prompts}"), prompts)
                for prompts in (False, True)}
        return {prompts: f.result() for prompts, f in runs.items()}


def test_spec_trace_without_prompts_is_refused_up_front(spec_recorded, capsys):
    """The scheduler's n-gram probe reads the prompt ids: without them replay would report a
    false ``schedule`` divergence, so it refuses the trace, naming the flag to re-record with."""
    from ppstate.replay.replayer import UnreplayableTrace
    run_dir = spec_recorded[False]
    run = load_run(run_dir)
    assert (run.header.scheduler["num_spec_tokens"], run.header.scheduler["spec_probe_ngram"],
            run.header.trace_prompts) == (2, 3, False)
    drafted = [e for e in run.engine if e["kind"] == "schedule"
               and max(e["output"]["num_scheduled_tokens"], default=0) > 1
               and not any(e["output"]["new_requests"])]
    assert drafted   # the run did carry drafts: the case that used to diverge
    want = (f"{run_dir}: cannot replay: recorded with --spec-tokens 2 and the n-gram probe on "
            "(--spec-probe-ngram 3) but without --trace-prompts; the probe decides each step's "
            "drafts from the prompt token ids, which 2 of the 2 arrivals lack, so replay would "
            "report a false divergence. Re-record with --trace-dir DIR --trace-prompts (or with "
            "--spec-probe-ngram 0)")
    with pytest.raises(UnreplayableTrace) as exc:
        replay(run_dir)
    assert str(exc.value) == want
    assert replay_main([str(run_dir)]) == 2
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", f"error: {want}\n")


def test_spec_trace_with_prompts_replays_clean(spec_recorded):
    run_dir = spec_recorded[True]
    res = replay(run_dir)
    assert res.ok and res.first_divergence is None, res.first_divergence
    run = load_run(run_dir)
    steps = sum(e["kind"] == "schedule" for e in run.engine)
    assert res.steps == steps and res.rank_steps == {0: steps, 1: steps}
    assert all(e["prompt_token_ids"] is not None for e in run.engine if e["kind"] == "arrival")


def test_engine_warns_when_its_spec_trace_will_not_replay(tmp_path, capsys):
    from runtime.engine.trace import start_trace_run
    cfg = EngineConfig(pp_size=2, num_spec_tokens=2, trace_dir=str(tmp_path))
    start_trace_run(cfg)
    assert capsys.readouterr().err == (
        "warning: --spec-tokens 2 is traced without --trace-prompts: python -m ppstate.replay "
        "will refuse this trace (the scheduler's n-gram probe, --spec-probe-ngram 3, reads the "
        "prompt ids); add --trace-prompts to replay it\n")
    for quiet in (cfg.model_copy(update={"trace_prompts": True}),
                  EngineConfig(pp_size=2, num_spec_tokens=2, spec_probe_ngram=0,
                               trace_dir=str(tmp_path)),
                  EngineConfig(pp_size=2, trace_dir=str(tmp_path))):
        start_trace_run(quiet)
        assert capsys.readouterr().err == ""


def test_until_a_skipped_step_or_past_the_end_says_so(tmp_path, capsys):
    """``--until 1`` where step 1 was skipped (one request at pp 2: a decode row is eligible
    every 2 numbers) printed "state after step 0", and ``--until 999`` "state after step 3",
    as if the flag had been ignored. The state is the one at the asked step (the events stamped
    up to it; a skipped number changes nothing), so it is kept and the heading says what the
    number was; ``state["last_step"]`` is the last step issued up to it."""
    from ppstate.sim.trace import record_sim
    from ppstate.sim.workload import SimConfig
    cfg = SimConfig(pp_size=2, num_requests=1, prompt_len=(4, 4), output_len=(4, 4), seed=0)
    _, run_dir = record_sim(cfg, tmp_path)
    assert [e["step"] for e in load_run(run_dir).engine if e["kind"] == "schedule"] == [0, 2, 3]

    def heading(until: int) -> tuple[str, dict]:
        assert replay_main([str(run_dir), "--until", str(until)]) == 0
        head, _, state = capsys.readouterr().out.splitlines()[-1].partition(": {")
        return head, json.loads("{" + state)

    head, state = heading(1)
    assert head == ("state at step 1, a skipped number (no step 1 was issued: it would have "
                    "carried no row); the last step issued before it: 0")
    assert (state["last_step"], state["next_step"], state["in_flight"]) == (0, 1, 1)
    head, state = heading(2)
    assert head == "state after step 2" and (state["last_step"], state["in_flight"]) == (2, 2)
    head, state = heading(999)
    assert head == "state at the end of the run: --until 999 is past its last step, 3"
    assert (state["last_step"], state["next_step"], state["in_flight"]) == (3, 4, 0)
    assert replay_main([str(run_dir), "--until", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"]["last_step"] == 0
    # a scheduler divergence at step 2 stops the replay there: not a skipped number
    _rewrite(run_dir / "engine.jsonl", lambda evs: [
        {**e, "output": {**e["output"], "num_scheduled_tokens": [2]}}
        if e["kind"] == "schedule" and e["step"] == 2 else e for e in evs])
    assert replay_main([str(run_dir), "--until", "999"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "state where replay stopped at a divergence, after step 0 (the run recorded steps up to 3 "
        "by --until 999): {")
