"""Forked requests (``RequestSpec.fork_of``, the ``n`` samples of one OpenAI request): a fork is
admitted only once its parent's prefill is scheduled, then shares every full prompt block through
the prefix cache (reference counts) and computes only the prompt's tail; the simulator runs
workloads of forks with every invariant checked."""

from __future__ import annotations

import numpy as np

from ppstate.batch import StepResult
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from ppstate.sim.simulator import Simulator
from ppstate.oracle.model import SimRequest
from ppstate.sim.workload import SimConfig


def cfg(**kw):
    base = dict(pp_size=1, mode="sync", max_num_seqs=8, max_num_batched_tokens=64,
                max_prefill_chunk=16, max_model_len=128, block_size=8, num_kv_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)


def answer(sched):
    out = sched.results.in_flight[0]
    ids = np.full((out.num_rows, 1), 7, dtype=np.int64)
    return sched.on_step_result(StepResult(out.step, ids, out.is_final_chunk.astype(np.int32),
                                           np.zeros(out.num_rows, dtype=np.int32)))


def test_forks_wait_for_the_parents_prefill_then_share_its_full_blocks():
    s = Scheduler(cfg())
    prompt = tuple(range(100, 140))                  # 40 tokens: 5 full blocks of 8
    s.add_request(RequestSpec("p", prompt, 4))
    for i in range(3):
        s.add_request(RequestSpec(f"f{i}", prompt, 4, fork_of="p"))
    first = s.schedule()                             # chunk 16: the parent only
    assert [n.req_id for n in first.new_requests] == ["p"]
    assert first.num_scheduled_tokens.tolist() == [16]
    answer(s)
    second = s.schedule()                            # chunk 16 more: forks still wait
    assert not second.new_requests
    answer(s)
    third = s.schedule()                             # the parent's last 8 tokens, then the forks
    assert [n.req_id for n in third.new_requests] == ["f0", "f1", "f2"]
    # each fork starts after the 4 full blocks the cache may give (>= 1 token left to compute)
    assert [n.num_cached_tokens for n in third.new_requests] == [32, 32, 32]
    assert third.num_scheduled_tokens.tolist() == [8, 8, 8, 8]
    parent_table = s.kv.pool.table("p")
    for i in range(3):
        assert s.kv.pool.table(f"f{i}")[:4] == parent_table[:4]
    assert s.kv.pool.ref_count[parent_table[0]] == 4
    assert s.num_prefill_tokens == 40 + 3 * 8
    while s.has_unfinished():
        answer(s)
        s.schedule()
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_fork_of_a_finished_or_absent_parent_is_admitted_at_once():
    s = Scheduler(cfg())
    s.add_request(RequestSpec("f", (1, 2, 3), 2, fork_of="gone"))
    assert [n.req_id for n in s.schedule().new_requests] == ["f"]


def test_simulator_runs_forked_workloads_without_violations():
    prompt = tuple(range(3, 60))
    work = (SimRequest("a", 0, prompt, 6, 11), SimRequest("b", 0, prompt, 6, 12, fork_of="a"),
            SimRequest("c", 0, prompt, 6, 13, fork_of="a", abort_at=3))
    res = Simulator(SimConfig(pp_size=2, workload=work, max_prefill_chunk=16)).run()
    assert res.num_violations == 0 and res.completed == 2
    for seed in range(4):
        r = Simulator(SimConfig(pp_size=2, num_requests=16, seed=seed, fork_rate=0.6,
                                abort_rate=0.2, prompt_len=(20, 70), num_kv_blocks=24)).run()
        assert r.num_violations == 0, r.invariant_violations[:2]
        assert r.prefix_hit_tokens > 0


def test_forks_prefill_the_prompt_once_where_independent_copies_recompute_it():
    prompt = tuple(range(3, 503))                    # 500 tokens: 31 full blocks + 4
    computed = {}
    for fork in (False, True):
        work = tuple(SimRequest(f"r{j}", 0, prompt, 16, 100 + j,
                                fork_of="r0" if fork and j else None) for j in range(8))
        sim = Simulator(SimConfig(pp_size=2, workload=work, max_prefill_chunk=64,
                                  max_num_batched_tokens=512, max_model_len=1024))
        assert sim.run().num_violations == 0
        computed[fork] = sim.sched.num_prefill_tokens
    assert computed[True] == 500 + 7 * 4             # each fork: the last partial block only
    assert computed[False] > 3 * computed[True]      # same-step admissions chunk the prompt again
