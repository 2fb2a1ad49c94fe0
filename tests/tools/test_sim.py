"""Deterministic PP simulator: invariants 1, 2, 3, 5, 6, 7, 9 over seeds, CLI, schedule efficiency."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ppstate.rank_step as rank_step
import ppstate.sim.rank as sim_rank
from ppstate.budget import SchedulerConfig
from ppstate.pp_handler import PPHandler
from ppstate.sim import Simulator, main, run_sim
from ppstate.oracle.model import SimRequest
from ppstate.sim.workload import SimConfig
from sim_sweep import sweep_config, sweep_violations

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"steps", "ticks", "completed", "aborted", "output_tokens", "throughput_tokens_per_tick",
        "bubble_fraction", "invariant_violations"}


def abort_reuse_config():
    """A decodes in the only slot, is aborted at tick 30; B (waiting) takes the slot at once."""
    return SimConfig(pp_size=2, max_num_seqs=1, workload=(
        SimRequest("A", 0, (5, 6, 7, 8), 40, 11, abort_at=30),
        SimRequest("B", 0, (9, 10, 11, 12), 5, 22)))


def no_generation_check(monkeypatch):
    monkeypatch.setattr(PPHandler, "_stale_rows",
                        lambda self, e: np.zeros(len(e.idx_mapping), dtype=bool))


def test_cli_json_and_determinism(capsys):
    argv = ["--pp", "3", "--requests", "12", "--seed", "5", "--mode", "overlapped",
            "--prompt-len", "4:40", "--output-len", "2:20", "--chunk", "16", "--abort-rate",
            "0.3", "--arrival", "poisson", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert KEYS <= set(first) and first["invariant_violations"] == []
    assert first["completed"] + first["aborted"] == 12
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert main(argv[:5] + ["6"] + argv[6:]) == 0
    assert json.loads(capsys.readouterr().out) != first


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "ppstate.sim", "--pp", "2", "--requests", "4",
                           "--seed", "1", "--mode", "sync", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["completed"] == 4 and data["bubble_fraction"] == 0.5


def test_cli_exit_1_prints_seed_and_repro(monkeypatch, capsys):
    no_generation_check(monkeypatch)
    cfg = sweep_config(0)
    assert run_sim(cfg).num_violations > 0
    rc = main(["--pp", "2", "--requests", "10", "--seed", "0", "--prompt-len", "1:40",
               "--output-len", "1:24", "--chunk", "8", "--max-num-seqs", "3",
               "--max-num-batched-tokens", "16", "--abort-rate", "0.25", "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    assert json.loads(captured.out)["invariant_violations"]
    assert "seed 0" in captured.err and "python -m ppstate.sim --pp 2 --requests 10 --seed 0" \
        in captured.err


def test_broadcast_skipped_for_all_non_final_chunk_steps():
    cfg = SimConfig(pp_size=3, max_prefill_chunk=8, workload=(
        SimRequest("long", 0, tuple(range(3, 43)), 2, 7),     # chunks at steps 0..4
        SimRequest("short", 0, (3, 4, 5), 1, 8)))             # row share 1: admitted at step 1
    sim = Simulator(cfg)
    res = sim.run()
    assert res.invariant_violations == []
    log = sim.checker.post_log
    assert [sim.outputs[s].is_final_chunk.tolist() for s in range(5)] == [
        [False], [False, True], [False], [False], [True]]
    assert [log[s] for s in range(5)] == [(False,) * 3, (True,) * 3, (False,) * 3,
                                          (False,) * 3, (True,) * 3]
    assert res.completed == 2


def test_abort_reuse_never_applies_old_token():
    sim = Simulator(abort_reuse_config())
    res = sim.run()
    assert res.invariant_violations == []
    assert (res.completed, res.aborted) == (1, 1)
    assert sim.checker.received["B"] == sim.checker.expected["B"].tokens
    reuse = [o for o in sim.outputs.values() if o.new_requests and o.new_requests[0].req_id == "B"]
    assert [(f.req_id, f.slot) for f in reuse[0].freed] == [("A", 0)]
    assert reuse[0].new_requests[0].slot == 0


def test_abort_reuse_violation_when_generation_check_off(monkeypatch):
    no_generation_check(monkeypatch)
    res = run_sim(abort_reuse_config())
    first = res.invariant_violations[0]
    assert (first["invariant"], first["rank"]) == (2, 0)
    assert first["message"] == "deferred token of A (step 6) applied to slot 0 now owned by B"
    assert {v["invariant"] for v in res.invariant_violations} == {2, 3}


def test_checker_catches_cadence_and_broadcast_mutants(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(SchedulerConfig, "cadence", property(lambda self: 1))
        assert 5 in {v["invariant"] for v in run_sim(sweep_config(1)).invariant_violations}
    last_rank_posts_every_nonempty_step(monkeypatch)
    assert {v["invariant"] for v in run_sim(sweep_config(1)).invariant_violations} == {1}


def last_rank_posts_every_nonempty_step(monkeypatch):
    """Plant a rank-local bug: the simulator's last rank publishes whenever the step has rows
    (ignoring the order's need-sampled mask) while the other ranks follow the mask."""
    publish = sim_rank.SimRank.publish
    monkeypatch.setattr(sim_rank.SimRank, "publish", lambda self, out, mask, payload: publish(
        self, out, np.ones(out.num_rows, dtype=bool) if out.num_rows else None, payload))


def _final_chunk_mask(out):
    return np.asarray(out.is_final_chunk, dtype=bool).copy() if out.num_rows else None


@pytest.mark.parametrize("wrong", ["post_all_non_final", "mask_all_rows", "skip_mixed"])
def test_wrong_broadcast_decision_agreed_by_all_ranks_is_caught(monkeypatch, wrong):
    """Every rank takes the same wrong decision (so the ranks never disagree); the checker's own
    statement of the rule (chunk positions vs prompt lengths) still reports invariant 1."""
    if wrong == "post_all_non_final":   # the chunked-PP hang: post although nobody needs a sample
        monkeypatch.setattr(rank_step, "need_sampled_mask", _final_chunk_mask)
    elif wrong == "mask_all_rows":       # non-final chunk rows marked as needing their sample
        monkeypatch.setattr(rank_step, "need_sampled_mask",
                            lambda out: np.ones(out.num_rows, dtype=bool) if out.num_rows else None)
    else:                                # a step with any non-final chunk row skips the broadcast
        def skip_mixed(out):
            m = _final_chunk_mask(out)
            return None if m is None or not m.all() else m
        monkeypatch.setattr(rank_step, "need_sampled_mask", skip_mixed)
    res = run_sim(sweep_config(1))
    assert 1 in {v["invariant"] for v in res.invariant_violations}
    assert not any("only" in v["message"] for v in res.invariant_violations)  # ranks agreed


def test_rows_needing_sample_rule():
    from ppstate.batch import SchedulerOutput
    from ppstate.oracle.invariants import InvariantOracle
    checker = InvariantOracle.__new__(InvariantOracle)
    checker.prompt_len = {"a": 10, "b": 4, "c": 7}
    checker.row_admission = {}
    out = SchedulerOutput(3, ("a", "b", "c"), np.array([0, 1, 2], dtype=np.int32),
                          np.array([6, 1, 7], dtype=np.int32), np.array([0, 5, 0], dtype=np.int32),
                          np.array([False, True, True]))
    assert checker.rows_needing_sample(out).tolist() == [False, True, True]
    # "a" re-admitted after a preemption at step 2 with 3 kept outputs: it prefills 13 tokens, so
    # a row ending at 10 is a non-final chunk and one ending at 13 needs its sample
    checker.row_admission = {(3, "a"): (2, 13, 3), (4, "a"): (2, 13, 3)}
    assert checker.rows_needing_sample(out).tolist() == [False, True, True]
    late = SchedulerOutput(4, ("a",), np.array([0], dtype=np.int32), np.array([3], dtype=np.int32),
                           np.array([10], dtype=np.int32), np.array([True]))
    assert checker.rows_needing_sample(late).tolist() == [True]
    early = SchedulerOutput(4, ("a",), np.array([0], dtype=np.int32), np.array([4], dtype=np.int32),
                            np.array([6], dtype=np.int32), np.array([False]))
    assert checker.rows_needing_sample(early).tolist() == [False]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_sim_cadence(pp):
    sim = Simulator(SimConfig(pp_size=pp, num_requests=24, seed=pp, abort_rate=0.2,
                              max_num_seqs=12, arrival="poisson"))
    assert sim.run().invariant_violations == []
    steps = {}
    for s in sorted(sim.outputs):
        o = sim.outputs[s]
        for rid, final in zip(o.req_ids, o.is_final_chunk):
            if final:
                steps.setdefault(rid, []).append(s)
    gaps = [b - a for v in steps.values() for a, b in zip(v, v[1:])]
    assert min(gaps) == pp


def test_burst_of_64_fills_all_4_in_flight_batches():
    sim = Simulator(SimConfig(pp_size=4, num_requests=64, seed=3, arrival="burst"))
    res = sim.run()
    assert res.invariant_violations == [] and res.completed == 64
    assert all(sim.outputs[s].num_rows > 0 for s in range(4))
    assert all(sim.outputs[s].total_tokens <= 64 for s in range(4))


def test_liveness_150_seeds():
    """Every admitted request finishes, no invariant breaks (CI's slice: seeds 0-149, run in two
    processes (tests/helpers/sim_sweep.py); the 10,000-seed soak runs outside CI:
    docs/reliability.md)."""
    runs = sweep_violations(range(150))
    assert sorted(runs) == list(range(150))
    bad = {seed: first for seed, (_, first) in runs.items() if first}
    assert bad == {}


@pytest.mark.slow
def test_sweep_60_more_seeds_with_aborts():
    """60 seeds past the liveness sweep's (CI's slice; the 10,000-seed soak,
    ``python -m ppstate.sim.soak --seeds 10000 --jobs N``, runs outside CI)."""
    runs = sweep_violations(range(150, 210))
    assert sorted(runs) == list(range(150, 210))
    bad = [s for s, (n, _) in runs.items() if n]
    assert bad == []


@pytest.mark.parametrize("pp,floor", [(4, 3.6), (2, 1.85)])
def test_schedule_efficiency_overlapped_vs_sync(pp, floor):
    ratios = []
    for seed in range(3):
        kw = dict(pp_size=pp, num_requests=64, seed=seed, prompt_len=(8, 32),
                  output_len=(64, 128), max_prefill_chunk=32, eos_prob=0.0)
        over, sync = run_sim(SimConfig(mode="overlapped", **kw)), run_sim(SimConfig(mode="sync", **kw))
        assert over.invariant_violations == [] == sync.invariant_violations
        assert over.output_tokens == sync.output_tokens
        ratios.append(over.throughput_tokens_per_tick / sync.throughput_tokens_per_tick)
    assert min(ratios) >= floor, ratios


@pytest.mark.parametrize("bcast,ticks", [(0, 26), (5, 31)])
def test_deferred_receive_waits_for_broadcast(bcast, ticks):
    # pp 2: step 0 final chunk (9 ticks/stage), 2 decode (3), 3 empty with freed (1); number 1
    # carried nothing and was skipped
    res = run_sim(SimConfig(pp_size=2, broadcast_ticks=bcast, workload=(
        SimRequest("a", 0, (3, 4, 5, 6), 2, 1),)))
    assert (res.steps, res.ticks, res.output_tokens) == (3, ticks, 2)
    assert res.bubble_fraction == round(1 - 26 / (2 * ticks), 6)   # busy 2 x (9 + 3 + 1)


def test_p2p_hand_off_latency_in_sync_mode():
    res = run_sim(SimConfig(pp_size=2, mode="sync", p2p_ticks=3, workload=(
        SimRequest("a", 0, (3, 4, 5, 6), 1, 1),)))
    # step 0: 9 + 3 + 9 ticks; step 1 (freed only): 1 + 3 + 1.
    assert (res.steps, res.ticks, res.completed) == (2, 26, 1)


def test_kv_preemption_and_prefix_sharing_sweep_and_block_mutant(monkeypatch):
    """Tight KV cache + shared prefix: preemptions and prefix hits happen with 0 violations;
    ranks that miss a block-table delta are caught (invariant 9)."""
    cfg = SimConfig(pp_size=3, num_requests=24, seed=5, shared_prefix=20, block_size=4,
                    num_kv_blocks=30, abort_rate=0.2, arrival="poisson")
    res = run_sim(cfg)
    assert res.num_violations == 0 and res.preemptions > 0 and res.prefix_hit_tokens > 0
    import ppstate.kv_manager as kvm
    real = kvm.KVManager._record
    monkeypatch.setattr(kvm.KVManager, "_record",
                        lambda self, slot, first, blocks: real(self, slot, first, blocks[:1]))
    bad = run_sim(cfg)
    assert bad.num_violations > 0 and {v["invariant"] for v in bad.invariant_violations} == {9}


def test_soak_slice_of_the_10000_seed_run():
    """A slice of ``python -m ppstate.sim.soak`` (the README reports the 10,000-seed figure):
    per-seed configurations with aborts, slot reuse, chunked prefill, bursts, preemption; in two
    processes (the next test shows ``jobs=2`` reports what the sequential run does)."""
    from ppstate.sim.soak import soak
    r = soak(range(40), jobs=2)
    assert (r["seeds"], r["runs_with_violations"], r["violation_seeds"]) == (40, 0, [])
    assert r["aborted"] > 0 and r["completed"] > 0 and r["requests"] == r["aborted"] + r["completed"]


def test_soak_jobs_report_equals_the_sequential_run():
    """``--jobs 2`` folds the per-seed results in seed order: the report is identical."""
    from ppstate.sim.soak import soak
    seeds = range(100, 106)
    seq = soak(seeds)
    assert soak(seeds, jobs=2) == seq
    assert seq["seeds"] == 6 and seq["steps"] > 0


def test_rank_local_block_shift_mutant_caught_before_the_forward():
    """Mutant ``rank_local_block_shift``: rank 1 writes one slot's block ids + 1 per step. The
    block-id agreement (invariant 9: each row's table is the scheduler's decision, by digest)
    names rank 1 and the slot at the first step, before its forward reads the wrong blocks."""
    from ppstate import mutants
    cfg = SimConfig(pp_size=3, num_requests=4, seed=5, block_size=4, num_kv_blocks=30)
    assert run_sim(cfg).num_violations == 0
    with mutants.enabled("rank_local_block_shift"):
        bad = run_sim(cfg)
    first = bad.invariant_violations[0]
    assert first["invariant"] == 9 and first["rank"] == 1 and first["step"] == 0, first
    assert "block ids of slot" in first["message"] and "differs from the scheduler's" in first["message"]
    assert {v["rank"] for v in bad.invariant_violations} == {1}
