"""Step-cost model, adaptive lanes and dynamic chunk sizing (ppstate.step_cost / lanes / chunk_sizing)."""

import dataclasses

import numpy as np
import pytest

import ppstate.sim.simulator as sim
from ppstate.batch import StepResult
from ppstate.budget import SchedulerConfig
from ppstate.chunk_sizing import chunk_limit, equal_time_chunk
from ppstate.errors import SchedulerError
from ppstate.lanes import choose_lanes, feasible, lane_open, lane_row_cap, lane_token_budget
from ppstate.scheduler import RequestSpec, Scheduler
from ppstate.sim.workload import SimConfig
from ppstate.step_cost import StepCostModel, fit, model_of


def test_fit_recovers_the_coefficients_of_synthetic_steps():
    true = StepCostModel(0.01, 0.0003, 0.002, 1e-6, 1.0)
    shapes = [(1, 1, 0), (8, 8, 0), (32, 32, 0), (1, 64, 64 * 63 / 2), (1, 64, 64 * (256 + 31.5)),
              (4, 100, 5000), (16, 16, 16 * 300)]
    samples = [(r, t, p, true.step_s(r, t, p)) for r, t, p in shapes]
    got = fit(samples, concurrency=1.3)
    assert got.base_s == pytest.approx(0.01) and got.per_row_s == pytest.approx(0.0003)
    assert got.per_token_s == pytest.approx(0.002) and got.per_prefix_token_s == pytest.approx(1e-6)
    assert got.concurrency == 1.3


def test_fit_clips_negative_terms_and_needs_four_samples():
    samples = [(r, r, 0.0, 0.01 + 0.001 * r) for r in (1, 2, 4, 8, 16)]  # rows == tokens: collinear
    got = fit(samples)
    assert min(got.base_s, got.per_row_s, got.per_token_s, got.per_prefix_token_s) >= 0
    assert got.step_s(8, 8) == pytest.approx(0.018)
    with pytest.raises(ValueError, match="at least 4"):
        fit(samples[:3])


def test_model_rejects_bad_coefficients_naming_them():
    with pytest.raises(ValueError, match="concurrency"):
        StepCostModel(concurrency=0.5)
    with pytest.raises(SchedulerError, match="per_token_s"):
        SchedulerConfig(cost_per_token_s=-1.0)
    cfg = SchedulerConfig(cost_base_s=0.5)
    assert model_of(cfg).base_s == 0.5 and model_of(cfg) is model_of(cfg)
    assert "_cost_model" not in dataclasses.asdict(cfg)  # the trace header stays the fields


def test_decode_round_and_lane_choice():
    flat = StepCostModel(base_s=0.01, per_row_s=0.0, per_token_s=0.0001, per_prefix_token_s=0.0,
                         concurrency=1.25)
    # 3 rows: 2 lanes cost 2 * (0.01 + 2e-4) * 1.25, one lane 2 * (0.01 + 3e-4)
    assert flat.decode_round_s(3, 2, 2) == pytest.approx(2 * 0.0102 * 1.25)
    assert flat.decode_round_s(3, 1, 2) == pytest.approx(2 * 0.0103)
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=64, adaptive_lanes=True, cost_base_s=0.01,
                          cost_per_row_s=0.0, cost_per_token_s=0.0001, cost_concurrency=1.25)
    assert choose_lanes(cfg, 3) == 1
    # 32 live: one lane 2 x (0.01 + 32e-4) = 0.0264 < 0.97 x 2 x (0.01 + 16e-4) x 1.25 = 0.0281
    assert choose_lanes(cfg, 32) == 1
    assert choose_lanes(dataclasses.replace(cfg, cost_per_token_s=0.0004), 32) == 2  # 0.0356 > 0.0341
    # 64 live: one lane 2 x (0.01 + 64e-4) = 0.0328 > 0.97 x 2 x (0.01 + 32e-4) x 1.25 = 0.0320
    assert choose_lanes(cfg, 64) == 2
    heavy = dataclasses.replace(cfg, cost_per_token_s=0.01)
    assert choose_lanes(heavy, 3) == 2   # per-row cost dominates: both lanes
    assert choose_lanes(dataclasses.replace(cfg, adaptive_lanes=False), 3) == 2
    assert choose_lanes(dataclasses.replace(cfg, mode="sync"), 3) == 2
    assert [lane_open(s, 1, 2) for s in range(4)] == [True, False, True, False]
    assert [lane_open(s, 2, 4) for s in range(5)] == [True, True, False, False, True]


def test_equal_time_chunks_shrink_as_the_prefix_grows():
    m = StepCostModel(per_token_s=0.001, per_prefix_token_s=1e-5)
    sizes, prefix = [], 0
    while prefix < 1000:
        n = equal_time_chunk(m, prefix, 64)
        sizes.append(n)
        target = m.chunk_s(64, 0)
        assert m.chunk_s(n, prefix) <= target * (1 + 1e-9)
        assert n == 64 or m.chunk_s(n + 1, prefix) > target
        prefix += n
    assert sizes[0] == 64 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 64
    assert equal_time_chunk(StepCostModel(per_prefix_token_s=0.0), 500, 64) == 64
    off = SchedulerConfig(max_prefill_chunk=64)
    on = dataclasses.replace(off, dynamic_chunks=True, cost_per_prefix_token_s=1.0)
    assert chunk_limit(off, 1000) == 64 and chunk_limit(on, 1000) == 16  # floor: one block


def _run(sched: Scheduler, steps: int) -> list:
    """Issue up to ``steps`` steps, answering the oldest in flight (token 7) when blocked."""
    outs = []
    while len(outs) < steps and (sched.has_unfinished() or sched.in_flight or sched.queues.freed):
        out = sched.schedule()
        if out is not None:
            outs.append(out)
            continue
        if not sched.in_flight:
            break
        o = sched.results.in_flight[0]
        n = o.num_rows
        sched.on_step_result(StepResult(o.step, np.full((n, 1), 7, np.int64),
                                        o.is_final_chunk.astype(np.int32), np.zeros(n, np.int32)))
    return outs


def test_one_lane_puts_every_decode_row_in_even_steps():
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=8, max_model_len=64, adaptive_lanes=True,
                          cost_base_s=0.01, cost_per_row_s=0.0, cost_per_token_s=1e-5)
    sched = Scheduler(cfg)
    for i in range(3):
        sched.add_request(RequestSpec(f"r{i}", (1, 2, 3, 4), max_tokens=6, eos_token_ids=frozenset()))
    outs = _run(sched, 40)
    decode = [(o.step, o.num_rows) for o in outs if o.num_rows and o.start_positions.min() >= 4]
    assert decode == [(2, 3), (4, 3), (6, 3), (8, 3), (10, 3)]   # one lane: even numbers only


def test_one_lane_issues_the_steps_sync_issues():
    """The closed lane's numbers carry nothing and are skipped: two 16-token requests in one
    lane take a prefill step, 15 decode steps and the step delivering their freed slots, as in
    sync mode; every issued step carries something."""
    def run(mode: str) -> list:
        sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=8, max_model_len=64, mode=mode,
                                          adaptive_lanes=True, cost_base_s=0.01,
                                          cost_per_row_s=0.0, cost_per_token_s=1e-5))
        for i in range(2):
            sched.add_request(RequestSpec(f"r{i}", (1, 2, 3, 4), max_tokens=16,
                                          eos_token_ids=frozenset()))
        outs = _run(sched, 100)
        assert not sched.has_unfinished() and not sched.in_flight
        return outs
    one, sync = run("overlapped"), run("sync")
    assert [o.step for o in one] == list(range(0, 31, 2)) + [31]   # 31: nothing live, all open
    assert [o.step for o in sync] == list(range(17))
    assert [o.num_rows for o in one] == [o.num_rows for o in sync] == [2] * 16 + [0]
    assert [f.req_id for f in one[-1].freed] == ["r0", "r1"]
    assert not any(o.carries_nothing for o in one + sync)


def test_one_lane_takes_sync_modes_rows_prefill_included():
    """A burst whose prefill needs several steps: with one lane every step with rows holds
    exactly the rows (ids, tokens, positions) of sync mode's step of the same index, at twice its
    number: prefill chunks and admissions take turns too, with sync's token budget."""
    def run(mode: str) -> list:
        sched = Scheduler(SchedulerConfig(pp_size=2, max_num_seqs=8, max_model_len=128,
                                          max_num_batched_tokens=64, max_prefill_chunk=32,
                                          mode=mode, adaptive_lanes=True, cost_base_s=0.01,
                                          cost_per_row_s=0.0, cost_per_token_s=1e-5))
        for i in range(6):
            sched.add_request(RequestSpec(f"r{i}", tuple(range(1 + i, 41 + i)), max_tokens=5,
                                          eos_token_ids=frozenset()))
        return _run(sched, 200)
    one, sync = ([o for o in run(m) if o.num_rows] for m in ("overlapped", "sync"))
    assert len(one) == len(sync) == 9 and [o.step for o in one] == [2 * o.step for o in sync]
    for a, b in zip(one, sync):
        assert a.req_ids == b.req_ids and a.num_scheduled_tokens.tolist() == \
            b.num_scheduled_tokens.tolist() and a.start_positions.tolist() == \
            b.start_positions.tolist()
    assert max(o.total_tokens for o in one) == 64   # sync's budget, not 64 / pp_size
    # (freed slots reach the ranks a step later than in sync: the results come one step behind)


def test_dynamic_chunks_split_a_long_prompt_into_shrinking_chunks():
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=2, max_model_len=512, max_prefill_chunk=64,
                          block_size=4, dynamic_chunks=True, cost_per_token_s=0.001,
                          cost_per_prefix_token_s=1e-5)
    sched = Scheduler(cfg)
    sched.add_request(RequestSpec("long", tuple(range(1, 401)), max_tokens=1))
    sizes = [int(o.num_scheduled_tokens[0]) for o in _run(sched, 30) if o.num_rows]
    m = model_of(cfg)
    expect, p = [], 0
    while p < 400:
        n = min(400 - p, equal_time_chunk(m, p, 64, 4))
        expect.append(n)
        p += n
    assert sizes == expect and sizes[0] == 64 and sizes[-2] < 64 and sum(sizes) == 400


@pytest.mark.parametrize("seed", range(12))
def test_simulator_invariants_hold_with_adaptive_lanes_and_dynamic_chunks(seed):
    # cheap steps dominated by the base cost: the lane policy picks 1 lane at low load
    sched = SchedulerConfig(pp_size=2 + seed % 3, max_prefill_chunk=16,
                            max_num_seqs=(3, 6, 16)[seed % 3], max_num_batched_tokens=64,
                            block_size=4, adaptive_lanes=True, dynamic_chunks=True,
                            cost_base_s=0.01, cost_per_row_s=0.0, cost_per_token_s=1e-4,
                            cost_per_prefix_token_s=2e-5)
    # stages sharing the machine (processor sharing) on two thirds of the seeds
    cfg = SimConfig(scheduler=sched, num_requests=10, seed=seed, prompt_len=(1, 90),
                    output_len=(1, 20), abort_rate=0.2,
                    arrival="poisson" if seed % 2 else "burst", contention=1.0 + 0.5 * (seed % 3),
                    empty_step_ticks=seed % 2 - 1)
    s = sim.Simulator(cfg)
    assert s.sched.config is sched and s.sched.config.adaptive_lanes
    res = s.run()
    assert res.invariant_violations == [] and res.completed + res.aborted == 10


def test_one_lane_may_carry_every_live_request_within_the_token_budget():
    cfg = SchedulerConfig(pp_size=2, max_num_seqs=64, max_num_batched_tokens=256,
                          adaptive_lanes=True, cost_base_s=0.1, cost_per_row_s=0.0,
                          cost_per_token_s=0.001, cost_concurrency=1.8)
    assert [lane_row_cap(cfg, n) for n in (1, 2)] == [64, 32] and cfg.max_rows_per_step == 32
    assert lane_row_cap(dataclasses.replace(cfg, mode="sync"), 2) == 64
    assert lane_row_cap(dataclasses.replace(cfg, pp_size=4), 3) == 22
    # 64 live: one lane 2 x 0.164 = 0.328 < 0.97 x 2 x 0.132 x 1.8 = 0.461 (the old cap of 32
    # rows per step forced both lanes here)
    assert choose_lanes(cfg, 64) == 1 and feasible(cfg, 64, 1)
    # one lane's step may take the whole token budget (one batch in the pipeline, as in sync)
    tight = dataclasses.replace(cfg, max_num_batched_tokens=64)
    assert tight.step_token_budget == 32 and lane_token_budget(tight, 1) == 64
    assert feasible(tight, 64, 1) and lane_token_budget(tight, 2) == 32
    # budget 32: 64 decode rows do not fit one step
    tighter = dataclasses.replace(cfg, max_num_batched_tokens=32)
    assert lane_token_budget(tighter, 1) == 32 and not feasible(tighter, 64, 1)
    assert feasible(tighter, 32, 1) and choose_lanes(tighter, 64) == 2
    assert choose_lanes(tighter, 32) == 1
    spec = dataclasses.replace(tighter, num_spec_tokens=1)   # 2 tokens per decode row
    assert not feasible(spec, 32, 1) and feasible(spec, 16, 1) and choose_lanes(spec, 32) == 2
    assert lane_token_budget(dataclasses.replace(cfg, mode="sync"), 1) == 256


def test_slowdown_grows_with_the_stages_computing_at_once_and_picks_the_argmin():
    m = StepCostModel(base_s=0.01, per_row_s=0.0, per_token_s=0.001, per_prefix_token_s=0.0,
                      concurrency=1.6)
    assert [m.slowdown(n, 4) for n in (1, 2, 3, 4, 9)] == pytest.approx([1.0, 1.2, 1.4, 1.6, 1.6])
    assert m.slowdown(2, 2) == 1.6 and m.slowdown(1, 2) == 1.0 and m.slowdown(3, 1) == 1.0
    assert m.decode_round_s(32, 2, 4) == pytest.approx(4 * 0.026 * 1.2)
    cfg = SchedulerConfig(pp_size=4, max_num_seqs=64, adaptive_lanes=True, cost_base_s=0.01,
                          cost_per_row_s=0.0, cost_per_token_s=0.001, cost_concurrency=1.6)
    # 32 live, estimates for 4, 3, 2, 1 lanes: 0.97 x 0.1152, 0.1176, 0.1248, 0.168 -> 4
    assert choose_lanes(cfg, 32) == 4
    # concurrency 2.2: 0.97 x 0.1584 = 0.1536, 0.1512, 0.1456, 0.168 -> 2 (neither end)
    assert choose_lanes(dataclasses.replace(cfg, cost_concurrency=2.2), 32) == 2


def test_simulator_runs_one_lane_of_64_rows_and_checks_the_cap_per_lane_count(monkeypatch):
    from ppstate.oracle import invariants as checks
    from ppstate.sim.lane_sweep import burst

    def sim_cfg():
        return SimConfig(pp_size=2, max_num_seqs=64, max_num_batched_tokens=4096,
                         max_prefill_chunk=512, max_model_len=48, adaptive_lanes=True,
                         cost_base_s=60.0, cost_per_row_s=0.0, cost_per_token_s=1.0,
                         cost_per_prefix_token_s=0.0, cost_concurrency=1.8, stage_base=60,
                         stage_per_token=1, contention=1.8, empty_step_ticks=1,
                         workload=burst(64, 16, 4))
    s = sim.Simulator(sim_cfg())
    issued = []
    s.checker.on_issue = lambda out, f=s.checker.on_issue: (issued.append(out), f(out))[1]
    res = s.run()
    assert res.invariant_violations == [] and res.completed == 64
    decode_rows = [o.num_rows for o in issued if o.num_rows and not o.new_requests]
    assert decode_rows and max(decode_rows) == 64 and all(o.step % 2 == 0 for o in issued
                                                          if o.num_rows and not o.new_requests)
    # the same run judged by the all-lanes cap (32 rows) is a violation of invariant 7
    monkeypatch.setattr(checks, "lane_row_cap", lambda cfg, lanes: cfg.max_rows_per_step)
    bad = sim.Simulator(sim_cfg()).run()
    assert bad.num_violations and {v["invariant"] for v in bad.invariant_violations} == {7}


def test_lane_sweep_adaptive_tracks_the_better_schedule_without_noise():
    from ppstate.sim.lane_sweep import point
    # stages slow each other down 1.8x (2 cores): one lane at every concurrency, exactly as fast
    # as sync (the closed lane's numbers are skipped, not issued); all lanes lose 18-43%
    rows = [point(n, 2, 60, 1, 1.8, 1) for n in (1, 4, 16, 64)]
    assert [r["lanes"] for r in rows] == [1, 1, 1, 1]
    assert all(r["adaptive"] == r["sync"] for r in rows)
    assert all(r["overlapped_over_sync"] < 0.85 for r in rows[1:])
    # no contention, cost grows with rows: all lanes, as fast as plain overlapped (> sync)
    free = [point(n, 2, 60, 4, 1.0, 1) for n in (4, 32)]
    assert [r["lanes"] for r in free] == [2, 2]
    assert all(r["adaptive"] == r["overlapped"] > r["sync"] for r in free)


def test_sim_cli_gives_the_lane_policy_the_simulators_own_cost_and_repro_keeps_it():
    from ppstate.sim.cli import build_parser, config_from_args
    cfg = config_from_args(build_parser().parse_args(
        ["--pp", "2", "--requests", "6", "--stage-cost", "60:1", "--contention", "1.8",
         "--empty-step-ticks", "1", "--adaptive-lanes"]))
    sc = cfg.scheduler
    assert (cfg.contention, cfg.empty_step_ticks, sc.adaptive_lanes) == (1.8, 1, True)
    assert (sc.cost_base_s, sc.cost_per_token_s, sc.cost_per_row_s, sc.cost_concurrency) == \
        (60.0, 1.0, 0.0, 1.8)
    res = sim.Simulator(cfg).run()
    assert res.invariant_violations == [] and res.completed == 6
    assert "--contention 1.8 --empty-step-ticks 1 --adaptive-lanes" in res.repro
    again = config_from_args(build_parser().parse_args(res.repro.split()[3:]))
    assert sim.Simulator(again).run() == res
    with pytest.raises(SchedulerError, match="contention"):
        SimConfig(contention=0.5)
