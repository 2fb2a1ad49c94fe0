"""The bounded model checker (``python -m ppstate.check``): clean on the real code at a small
bound, every mutant caught with a counterexample that ``python -m ppstate.replay`` re-finds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ppstate import mutants
from ppstate.check import CheckConfig, explore
from ppstate.check.__main__ import main as check_main
from ppstate.check import slot_labels
from ppstate.check.canon import _dead, canonical_key, scrub
from ppstate.check.cycles import EdgeLog
from ppstate.check.verify import check_bisimulation
from ppstate.check.choices import Chooser
from ppstate.check.comm import Comm
from ppstate.check.snapshot import digest, dumps
from ppstate.check.world import World
from ppstate.check.counterexample import write_counterexample
from ppstate.pp_handler import PPHandler
from ppstate.batch import SchedulerOutput
from ppstate.replay.replayer import replay

import numpy as np

# Small bounds: each test explores at most about a thousand states (seconds of CPU).
BASE = dict(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 2), abort_anywhere=True)

# mutant -> (config, invariant of the first violation)
MUTANT_CASES = {
    "rank_local_skip": (dict(pp_size=2, num_requests=1, max_tokens=(1, 1)), 1),
    "no_generation_check": (dict(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 2),
                                 abort_anywhere=True), 2),
    "short_cadence": (dict(pp_size=2, num_requests=1, prompt_len=(1, 1), max_tokens=(2, 2)), 5),
    "blocking_all_chunk_broadcast": (dict(pp_size=2, num_requests=1, prompt_len=(3, 3),
                                          max_tokens=(1, 1)), 1),
    "no_rejected_correction": (dict(pp_size=2, num_requests=1, prompt_len=(1, 1),
                                    max_tokens=(2, 2), spec_tokens=1), 4),
    "rank_local_block_shift": (dict(pp_size=2, num_requests=1, prompt_len=(1, 1),
                                    max_tokens=(1, 1)), 9),
    "grammar_on_rejected": (dict(pp_size=2, num_requests=1, prompt_len=(1, 1),
                                 max_tokens=(2, 2), spec_tokens=1, grammar=True), 4),
}


def test_baseline_clean_at_a_small_bound():
    # verify.py's whole-state graph at BASE has 1,867 states (2,541 before steps that carry
    # nothing were skipped, 2,795 before restored objects pickled like constructed ones); the
    # canonical form merges them into the 109 classes verify.py finds at this bound
    res = explore(CheckConfig(**BASE))
    assert res.complete and res.violations == []
    assert (res.states, res.transitions, res.depth) == CANON_B0


# canonical states / transitions / depth at BASE: the same under every PYTHONHASHSEED. 729 /
# 1,246 / 11 before settled leftovers were erased and renamed (canon.py, leftovers.py: 247),
# stale row epochs and leftover counters normalised (215), the free list sorted at the end
# (206), the log cursors reset (197), arrays, op names and comm keys pickled independently of
# object identity (162: each earlier count had states that differed only in how their pickle
# shared equal objects) and slots labelled canonically (146, slot_labels.py); steps that carry
# nothing skipped instead of issued (109)
CANON_B0 = (109, 276, 6)


def test_adaptive_lanes_clean_and_the_closed_lane_skips_its_numbers():
    # one live request: one lane (LANE_COSTS), so its decode rows run at even numbers only and
    # the odd ones are skipped; two live: both lanes. The canonical shift keeps step mod pp
    res = explore(CheckConfig(adaptive_lanes=True, **BASE))
    assert res.complete and res.violations == [] and (res.states, res.depth) == (105, 6)  # = verify.py's classes
    w = World(CheckConfig(pp_size=2, num_requests=1, prompt_len=(1, 1), max_tokens=(3, 3),
                          adaptive_lanes=True), record=True)
    w.settle()
    assert w.apply(("arrive", 1, 3), Chooser((0, 0, 0)))
    while w.results:
        assert w.apply(("deliver",), Chooser((0,)))
    issued = [e["step"] for e in w.sched_sink.events if e["kind"] == "schedule"]
    assert issued == [0, 2, 4, 5]   # 5: the step that delivers r0's freed slot
    assert w.monitor.inner.sampling_steps["r0"] == [0, 2, 4]
    assert [rk.next_step for rk in w.ranks] == [6, 6]
    assert w.violations == [] and not w.unfinished()


def test_canonical_counts_do_not_depend_on_the_hash_seed():
    code = ("from ppstate.check import CheckConfig, explore; r = explore(CheckConfig(pp_size=2, "
            "num_requests=2, prompt_len=(1, 1), max_tokens=(1, 1), abort_anywhere=True)); "
            "print(r.states, r.transitions, r.depth)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in "12"}
    assert len(outs) == 1, outs


def test_canonical_form_is_a_bisimulation():
    # every reachable whole state: one verdict and one set of successor keys per canonical key,
    # also when the code runs on the scrubbed world (ppstate/check/verify.py); the second bound
    # has 3 KV blocks for two 4-token requests: preemption, prefix hits on the preempted
    # request's cached blocks, re-admission epochs and renamed blocks
    # (and the third, adaptive lanes: numbers skipped, shifts that keep step mod pp_size, the
    # next step below pp_size after the shift; it caught two canonical-form bugs of that case)
    for kw in (dict(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 1),
                    abort_anywhere=True),
               dict(pp_size=2, num_requests=2, prompt_len=(3, 3), max_tokens=(2, 2),
                    num_kv_blocks=3),
               dict(pp_size=3, num_requests=2, prompt_len=(1, 1), max_tokens=(2, 2),
                    adaptive_lanes=True)):
        got = check_bisimulation(CheckConfig(**kw))
        assert got["complete"] and got["mismatches"] == [], got
        assert got["classes"] < got["states"]
        assert got["explored"] == got["classes"]   # the explorer finds each class, nothing else


def test_settled_leftover_is_erased_and_renamed():
    # r0 is aborted while its first two sampled rows are still undelivered; whether its first
    # token was EOS (which stops the last rank's later branch) no longer matters to any future
    cfg = CheckConfig(pp_size=2, num_requests=1, prompt_len=(1, 1), max_tokens=(2, 2),
                      abort_anywhere=True)
    worlds = []
    for eos in (0, 1):
        w = World(cfg)
        w.settle()
        assert w.apply(("arrive", 1, 2), Chooser((eos,)))
        assert w.results[0].sampled_token_ids.tolist() == ([[2]] if eos else [[11546]])
        assert w.apply(("abort", "r0"), Chooser())
        worlds.append(w)
    assert canonical_key(worlds[0].clone()) == canonical_key(worlds[1].clone())
    s = worlds[1].clone()
    scrub(s)
    slot = s.ranks[0].slot_tokens.owner.index("z0")   # which slot: the labelling with the least key
    assert [sorted(rk.slot_tokens.owner, key=str) for rk in s.ranks] == [[None, "z0"], [None, "z0"]]
    assert all(rk.slot_tokens.owner[slot] == "z0" for rk in s.ranks)
    assert s.results[0].sampled_token_ids.tolist() == [[0]] and s.ranks[1].slot_tokens.history[slot] == []
    assert s.monitor.inner.closed == {"z0": "closed"} and s.monitor.delivered == {}
    assert s.sched.results.in_flight_epochs[0].tolist() == [-1]   # never matches a slot again


def test_slot_labels_are_names():
    # both slots occupied, deferred rows queued for each: swapping the two slots everywhere
    # (slot_labels.relabel) gives a world with the same canonical key, after every delivery
    cfg = CheckConfig(pp_size=2, num_requests=3, prompt_len=(1, 3), max_tokens=(1, 3),
                      abort_anywhere=True)
    w = World(cfg)
    w.settle()
    assert w.apply(("arrive", 3, 3), Chooser()) and w.apply(("arrive", 1, 2), Chooser())
    while "r1" not in w.ranks[0].slot_tokens.owner:
        assert w.apply(("deliver",), Chooser())
    assert w.ranks[0].slot_tokens.owner == ["r0", "r1"] and len(w.ranks[0].handler._fifo) == 2
    while True:
        swapped = w.clone()
        slot_labels.relabel(swapped, [1, 0])
        assert swapped.ranks[1].slot_tokens.owner == w.ranks[1].slot_tokens.owner[::-1]
        assert canonical_key(w.clone()) == canonical_key(swapped)
        if not w.results:
            break
        assert w.apply(("deliver",), Chooser())


def test_cycle_check_finds_a_loop_of_engine_moves():
    log = EdgeLog()
    for a, b in ((0, 1), (1, 2), (2, 3), (0, 3)):
        log.add(a, b, ("deliver",), ())
    assert log.find_cycle() is None                       # a DAG: no livelock
    log.add(3, 1, ("issue",), ())
    start, moves = log.find_cycle()
    assert start in (1, 2, 3) and len(moves) == 3 and ("issue",) in [m[0] for m in moves]


def test_canonical_keys_keep_the_verdict_and_merge_histories():
    kw = dict(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 1), abort_anywhere=True)
    canon, full = explore(CheckConfig(**kw)), explore(CheckConfig(**kw), canon=False)
    assert canon.complete and full.complete and canon.violations == full.violations == []
    assert canon.states < full.states and canon.depth <= full.depth
    # r0 ends by EOS or by length at its one token, then r1 arrives and ends: different
    # histories (tokens, finish reason, step numbers), one future
    cfg = CheckConfig(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 1))
    worlds = []
    for eos in (0, 1):
        w = World(cfg)
        w.settle()
        assert w.apply(("arrive", 1, 1), Chooser((eos,)))
        while w.results:
            assert w.apply(("deliver",), Chooser())
        assert "r0" in w.monitor.inner.closed and not w.sched.is_live("r0")
        assert w.apply(("arrive", 1, 1), Chooser((0,)))
        while w.results:
            assert w.apply(("deliver",), Chooser())
        assert "r0" in _dead(w)   # no kept step, slot or result names it any more
        worlds.append(w)
    assert digest(dumps(worlds[0])) != digest(dumps(worlds[1]))
    before = dumps(worlds[0])
    assert canonical_key(worlds[0].clone()) == canonical_key(worlds[1].clone())
    assert dumps(worlds[0]) == before   # keys come from a copy; the world is not touched
    scrubbed = worlds[0].clone()
    scrub(scrubbed)
    assert scrubbed.sched.next_step == 0 and worlds[0].sched.next_step > 0   # relative steps


def test_parallel_bfs_matches_one_process():
    kw = dict(pp_size=2, num_requests=2, prompt_len=(1, 1), max_tokens=(1, 1), abort_anywhere=True)
    one, two = explore(CheckConfig(**kw)), explore(CheckConfig(**kw), jobs=2)
    assert (one.states, one.transitions, one.depth) == (two.states, two.transitions, two.depth)
    assert two.complete and two.violations == []
    kw, invariant = MUTANT_CASES["short_cadence"]
    one, two = (explore(CheckConfig(mutant="short_cadence", **kw), jobs=j) for j in (1, 2))
    assert two.violations[0]["invariant"] == invariant and two.path == one.path


def test_grammar_position_clean_with_aborts_rejections_and_preemption():
    """Structured outputs (#31): every request grammar-constrained, drafts rejected, requests
    aborted anywhere and preempted (3 KV blocks): the last rank's matcher position always equals
    the accepted output tokens."""
    res = explore(CheckConfig(pp_size=2, num_requests=2, prompt_len=(1, 2), max_tokens=(2, 2),
                              spec_tokens=1, grammar=True, abort_anywhere=True, num_kv_blocks=3))
    assert res.complete and res.violations == [] and res.states > 250, res.violations[:2]


def test_baseline_clean_pp3_sync_and_spec_tokens():
    for kw in (dict(pp_size=3, num_requests=1, prompt_len=(1, 3), max_tokens=(1, 2)),
               dict(pp_size=2, num_requests=2, prompt_len=(1, 2), max_tokens=(1, 1), mode="sync"),
               dict(pp_size=2, num_requests=1, prompt_len=(1, 2), max_tokens=(2, 3),
                    spec_tokens=1)):
        res = explore(CheckConfig(**kw))
        assert res.complete and res.violations == [], (kw, res.violations[:2])


@pytest.mark.parametrize("name", sorted(MUTANT_CASES))
def test_mutant_caught_and_counterexample_replays(name, tmp_path):
    kw, invariant = MUTANT_CASES[name]
    cfg = CheckConfig(mutant=name, **kw)
    res = explore(cfg)
    assert res.violations, f"{name} not caught"
    assert res.violations[0]["invariant"] == invariant, res.violations
    run_dir = write_counterexample(cfg, res.path, tmp_path)
    got = replay(run_dir)
    assert not got.ok
    assert invariant in {v["invariant"] for v in got.invariant_violations}, \
        (got.invariant_violations, got.first_divergence)
    assert not mutants.active(name)   # switched off again after the run


def test_mutants_are_caught_without_partial_order_reduction_too():
    for name in ("rank_local_skip", "short_cadence"):
        kw, invariant = MUTANT_CASES[name]
        res = explore(CheckConfig(mutant=name, por=False, async_engine=True, **kw))
        assert res.violations and res.violations[0]["invariant"] == invariant


def test_no_por_baseline_agrees_with_por_on_verdict():
    kw = dict(pp_size=2, num_requests=1, prompt_len=(1, 2), max_tokens=(1, 1))
    por = explore(CheckConfig(**kw))
    full = explore(CheckConfig(por=False, async_engine=True, **kw))
    assert por.violations == [] and full.violations == []
    assert full.states > por.states   # rank order and issue timing explored as well


def test_comm_orders_ops_per_group_and_detects_a_mismatch():
    comm = Comm(2)
    send = comm.issue("pp", "send", 0, step=0, peer=1, payload="h0")
    bc0 = comm.issue("pp", "bcast", 0, step=0)                    # behind the send on rank 0
    assert not send.done and not bc0.done
    bc1 = comm.issue("pp", "bcast", 1, step=0, payload="ids", is_root=True)
    assert not bc1.done                                            # rank 1's recv not issued
    recv = comm.issue("pp", "recv", 1, step=0, peer=0)
    assert not recv.done           # rank 1 issued its broadcast first: ops complete in issue order
    assert comm.pending() == [send, bc0, bc1, recv]   # a deadlock: each waits behind the other
    comm2 = Comm(2)
    comm2.issue("bcast", "bcast", 0, step=3)
    comm2.issue("bcast", "bcast", 1, step=4, payload="x", is_root=True)
    (msg, step), = comm2.take_mismatches()
    assert "rank 0 receives step 3, rank 1 sends step 4" in msg and step == 3


def test_generation_check_hook_is_in_the_real_pp_handler():
    out = SchedulerOutput(0, ("a",), np.array([0], np.int32), np.array([1], np.int32),
                          np.array([0], np.int32), np.array([True]))
    for on, want in ((False, None), (True, [0])):
        h = PPHandler(1, 1)
        h.consume()
        h.enqueue(0, out, np.array([True]))
        h.on_slot_freed(0)
        with mutants.enabled(*(["no_generation_check"] if on else [])):
            entry = h.consume()
        assert (entry if entry is None else entry.idx_mapping.tolist()) == want


def test_unknown_mutant_is_refused():
    with pytest.raises(KeyError, match="unknown mutant 'nope'"):
        with mutants.enabled("nope"):
            raise AssertionError("the block ran with an unknown mutant")
    assert not mutants.active("no_generation_check")   # nothing left switched on


def test_cli_json_exit_status_and_flag_errors(tmp_path, capsys):
    assert check_main(["--pp", "2", "--requests", "1", "--prompt-len", "1:2", "--max-tokens",
                       "1:2", "--json", "--trace-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_violations"] == 0 and out["states"] > 10 and out["counterexample"] is None
    assert check_main(["--requests", "1", "--max-tokens", "1:1", "--mutant", "rank_local_skip",
                       "--json", "--trace-dir", str(tmp_path)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["violations"][0]["invariant"] == 1 and out["counterexample"].startswith(str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        check_main(["--mutant", "no_rejected_correction"])
    assert exc.value.code == 2 and "--spec-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        check_main(["--prompt-len", "3:1"])
    assert "--prompt-len" in capsys.readouterr().err
    assert check_main(["--list-mutants"]) == 0
    assert "short_cadence" in capsys.readouterr().out


def test_docs_show_the_current_help(monkeypatch):
    from pathlib import Path
    from ppstate.check.__main__ import build_parser
    monkeypatch.setenv("COLUMNS", "100")
    doc = (Path(__file__).resolve().parents[2] / "docs" / "checker.md").read_text(encoding="utf-8")
    assert build_parser().format_help().rstrip("\n") in doc
