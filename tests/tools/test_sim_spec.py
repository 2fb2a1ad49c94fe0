"""Speculative decoding in the simulator (issue #33): proposer, verify, checks, mutants, soak."""

import json

import numpy as np
import pytest

from ppstate import mutants
from ppstate.oracle.model import model_token
from ppstate.sim import Simulator, main, run_sim
from ppstate.sim.soak import soak, soak_config, spec_seed
from ppstate.sim.spec import propose, verify
from ppstate.sim.workload import SimConfig


def spec_config(**kw):
    base = dict(pp_size=3, num_requests=12, seed=1, num_spec_tokens=3, spec_acceptance=0.6)
    return SimConfig(**{**base, **kw})


def test_proposer_acceptance_one_gives_the_models_tokens_zero_none():
    seed, index, prev = 1234, 5, 77
    want, p = [], prev
    for i in range(4):
        p = model_token(seed, index + i, p, -1)
        want.append(p)
    assert propose(seed, index, prev, 4, 1.0, -1) == want
    assert propose(seed, index, prev, 0, 1.0, -1) == []
    wrong = propose(seed, index, prev, 4, 0.0, -1)
    assert wrong[0] != want[0] and len(wrong) == 4
    # rank 0 and the last rank compute the same drafts from the same history
    assert propose(seed, index, prev, 3, 0.5, -1) == propose(seed, index, prev, 3, 0.5, -1)


def test_verify_keeps_the_longest_matching_prefix_plus_the_bonus_token():
    seed, index, prev = 99, 3, 50
    t0 = model_token(seed, index, prev, -1)
    t1 = model_token(seed, index + 1, t0, -1)
    bad = t1 + 1 if t1 + 1 < 49152 else 3
    # row 0: drafts [t0 (right), bad (wrong)] -> emits t0, t1 (bonus); 1 rejected
    # row 1: no drafts (a final prefill chunk) -> one token
    inputs = np.array([[prev, t0, bad], [prev, -1, -1]])
    drafts = np.array([[t0, bad], [0, 0]])
    p = verify(inputs, np.array([2, 0]), drafts, np.array([seed, seed]), np.array([index, index]),
               np.array([-1, -1]), np.array([0, 1]), 3)
    assert p.width == 3 and p.buf.shape == (2, 5)
    assert p.num_sampled.tolist() == [2, 1] and p.num_rejected.tolist() == [1, 0]
    assert p.token_ids[0, :2].tolist() == [t0, t1] and p.token_ids[0, 2] == 0
    assert p.token_ids[1].tolist() == [t0, 0, 0]


def test_speculative_run_is_clean_and_delivers_the_same_tokens_in_fewer_steps():
    off = run_sim(spec_config(num_spec_tokens=0))
    on = run_sim(spec_config())
    assert off.num_violations == 0 and on.num_violations == 0 and off.spec is None
    assert (on.completed, on.output_tokens) == (off.completed, off.output_tokens) == (12, 193)
    assert (off.steps, on.steps) == (81, 48)
    assert on.spec == {"spec_proposed_tokens": 242, "spec_accepted_tokens": 94,
                       "spec_decode_rows": 88}


def test_payload_is_k_plus_3_wide_and_rows_carry_0_to_k_drafts():
    sim = Simulator(spec_config(max_num_batched_tokens=16, num_requests=16))
    res = sim.run()
    assert res.num_violations == 0
    widths = {p.buf.shape[1] for p in sim.wire.broadcast.values()}
    assert widths == {3 + 3}
    rejected = np.concatenate([p.num_rejected for p in sim.wire.broadcast.values()])
    sampled = np.concatenate([p.num_sampled for p in sim.wire.broadcast.values()])
    assert set(rejected.tolist()) == {0, 1, 2, 3} and set(sampled.tolist()) == {0, 1, 2, 3, 4}
    carried = {int(k) for out in sim.outputs.values() for k in out.num_scheduled_tokens}
    assert {1, 2, 3, 4} <= carried     # decode rows of 1 + k tokens, k = 0 .. 3


def test_keep_rejected_draft_mutant_caught_with_a_replayable_seed(capsys):
    with mutants.enabled("keep_rejected_draft"):
        res = run_sim(spec_config(pp_size=2, num_requests=4, seed=0, num_spec_tokens=2,
                                  spec_acceptance=0.5))
    first = res.invariant_violations[0]
    assert (first["invariant"], first["step"], first["rank"]) == (8, 2, 0)
    assert first["message"] == ("req-0: 32 KV positions computed after step 2, accepted tokens "
                                "cover 30")
    assert {v["invariant"] for v in res.invariant_violations} >= {8, 9}
    # the CLI reproduces it from the seed and says how
    argv = (res.repro.split()[3:]) + ["--mutant", "keep_rejected_draft"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["num_violations"] == res.num_violations and out["trace"] is not None
    with mutants.enabled("no_rejected_correction"):   # the checker's mutant, caught here too
        res = run_sim(spec_config(pp_size=2, num_requests=4, seed=0, num_spec_tokens=2))
    assert res.invariant_violations[0]["invariant"] == 4


def test_checker_refuses_the_simulator_only_mutant(capsys):
    from ppstate.check.__main__ import main as check_main
    with pytest.raises(SystemExit) as exc:
        check_main(["--spec-tokens", "1", "--mutant", "keep_rejected_draft"])
    assert exc.value.code == 2 and "ppstate.sim" in capsys.readouterr().err


def test_cli_without_speculation_prints_no_spec_key(capsys):
    assert main(["--pp", "2", "--requests", "3", "--json"]) == 0
    assert "spec" not in json.loads(capsys.readouterr().out)
    assert main(["--pp", "2", "--requests", "3", "--spec-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["spec_decode_rows"] > 0 and "--spec-tokens 2" in out["repro"]
    assert "--spec-acceptance 0.7" in out["repro"]        # SimConfig's default when not given


def test_soak_speculates_on_every_third_seed():
    assert [s for s in range(12) if spec_seed(s)] == [0, 5, 7, 9]
    assert sum(spec_seed(s) for s in range(3000)) == 1000
    cfg = soak_config(5)
    assert (cfg.scheduler.num_spec_tokens, cfg.spec_acceptance, cfg.scheduler.pp_size) == (1, 0.6, 4)
    assert soak_config(1).scheduler.num_spec_tokens == 0
    r = soak(range(0, 12))
    assert (r["seeds"], r["spec_seeds"], r["runs_with_violations"]) == (12, 4, 0)
    assert 0 < r["spec_accepted_tokens"] < r["spec_proposed_tokens"]
