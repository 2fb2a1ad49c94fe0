"""``python -m ppstate.sim.soak``: the simulator over many seeds (issue #12, item 7).

Each seed picks its own configuration (:func:`soak_config`): 2-4 stages, overlapped or sync,
aborts at random ticks, few slots for many requests (slot reuse), prefill chunks smaller than
the prompts (chunked prefill), burst or Poisson arrivals, a tight or roomy KV cache (preemption),
prefix caching on or off, adaptive lanes on half of the overlapped seeds (:data:`LANE_COSTS`:
the lane count changes with the live requests, closed lanes skip their step numbers), and
speculative decoding on every third seed (:func:`spec_seed`: K = 1-4 drafts per decode row,
draft acceptance 0.3, 0.6 or 0.9; :mod:`ppstate.sim.spec`). Every
simulator run checks the invariants at every tick
(:mod:`ppstate.oracle.invariants`). Prints one JSON object: seeds run, runs with violations (their
seeds, at most 20) and totals (requests, aborted, steps; speculative seeds and their drafts
proposed / accepted); exit status 1 on any violation.
Reproduce one seed with ``--start SEED --seeds 1``. ``--jobs N`` runs the seeds in N processes
(``multiprocessing``); each seed's run is independent and the results are folded in seed order, so
the JSON equals the sequential run's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from collections.abc import Iterable, Iterator

from ppstate.sim import cli_args as arg
from ppstate.sim.simulator import run_sim
from ppstate.sim.workload import SimConfig


#: step-cost coefficients (ticks) of the adaptive-lanes seeds: with up to 16 live requests
#: :func:`ppstate.lanes.choose_lanes` picks every count from 1 to pp_size (pp 4: 1, 2, 3, 2,
#: 3, 3, 4, 4, 3, 4, ... for 1, 2, ... live)
LANE_COSTS = {"cost_base_s": 8.0, "cost_per_row_s": 0.0, "cost_per_token_s": 1.0,
              "cost_per_prefix_token_s": 0.0, "cost_concurrency": 1.3}


def spec_seed(seed: int) -> bool:
    """Whether soak seed ``seed`` speculates: every third seed, spread over the stage counts
    (``seed + seed // 3`` so that it is not always the same ``seed % 3``, which picks pp)."""
    return (seed + seed // 3) % 3 == 0


def soak_config(seed: int) -> SimConfig:
    """The simulator configuration of soak seed ``seed`` (deterministic). The speculative
    seeds (:func:`spec_seed`) add drafts to the configuration the seed has without them."""
    pp = 2 + seed % 3
    slots = (2, 4, 8, 16)[(seed // 3) % 4]
    chunk = (4, 8, 16, 32)[(seed // 5) % 4]
    bs = (1, 4, 16)[(seed // 7) % 3]
    need = -(-(48 + 32) // bs)                      # one request of the longest kind
    blocks = need * (1, 2, slots)[(seed // 11) % 3]  # tight: preemption; roomy: none
    mode = "sync" if seed % 6 == 5 else "overlapped"
    lanes = dict(adaptive_lanes=True, **LANE_COSTS) if (seed // 17) % 2 else {}
    spec = dict(num_spec_tokens=1 + (seed // 7) % 4,
                spec_acceptance=(0.3, 0.6, 0.9)[(seed // 5) % 3]) if spec_seed(seed) else {}
    return SimConfig(pp_size=pp, num_requests=8 + seed % 25, seed=seed, mode=mode, **lanes, **spec,
                     prompt_len=(1, 48), output_len=(1, 32), max_prefill_chunk=chunk, max_num_seqs=slots,
                     max_num_batched_tokens=(16, 32, 128)[(seed // 13) % 3],
                     abort_rate=(0.0, 0.2, 0.5)[seed % 3 if seed % 4 else 1],
                     arrival="burst" if seed % 2 else "poisson", eos_prob=(0.0, 0.3)[seed % 2],
                     p2p_ticks=seed % 2, broadcast_ticks=(seed // 2) % 3,
                     block_size=bs, num_kv_blocks=blocks, enable_prefix_caching=seed % 4 != 3)


def run_seed(seed: int) -> tuple[int, int, int, int, int, int, int]:
    """``(seed, completed, aborted, steps, violations, drafts proposed, drafts accepted)`` of one
    soak seed (picklable, for workers; the drafts are 0 on seeds without speculation)."""
    res = run_sim(soak_config(seed))
    spec = res.spec or {}
    return (seed, res.completed, res.aborted, res.steps, res.num_violations,
            spec.get("spec_proposed_tokens", 0), spec.get("spec_accepted_tokens", 0))


def _results(seeds: Iterable[int], jobs: int) -> Iterator[tuple[int, ...]]:
    """:func:`run_seed` of every seed, in the order of ``seeds`` (``jobs`` processes if > 1)."""
    if jobs <= 1:
        yield from map(run_seed, seeds)
        return
    seeds = list(seeds)
    chunk = max(1, min(64, len(seeds) // (4 * jobs)))
    with mp.get_context("spawn").Pool(jobs) as pool:
        yield from pool.imap(run_seed, seeds, chunksize=chunk)  # imap keeps the input order


def soak(seeds: Iterable[int], jobs: int = 1) -> dict:
    """Run every seed (in ``jobs`` processes); returns counts, totals and the seeds with
    violations (the first 20, in seed order; identical for every ``jobs``)."""
    report = {"seeds": 0, "runs_with_violations": 0, "violation_seeds": [], "violations": 0,
              "requests": 0, "aborted": 0, "completed": 0, "steps": 0, "spec_seeds": 0,
              "spec_proposed_tokens": 0, "spec_accepted_tokens": 0}
    for seed, completed, aborted, steps, violations, proposed, accepted in _results(seeds, jobs):
        report["seeds"] += 1
        report["spec_seeds"] += spec_seed(seed)
        report["spec_proposed_tokens"] += proposed
        report["spec_accepted_tokens"] += accepted
        report["requests"] += completed + aborted
        report["aborted"] += aborted
        report["completed"] += completed
        report["steps"] += steps
        if violations:
            report["runs_with_violations"] += 1
            report["violations"] += violations
            if len(report["violation_seeds"]) < 20:
                report["violation_seeds"].append(seed)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ppstate.sim.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=arg.positive, default=10_000, help="number of seeds")
    p.add_argument("--start", type=arg.non_negative, default=0, help="first seed")
    p.add_argument("--jobs", type=arg.positive, default=1,
                   help="worker processes (same report as 1)")
    args = p.parse_args(argv)
    report = soak(range(args.start, args.start + args.seeds), jobs=args.jobs)
    print(json.dumps(report), flush=True)
    return 1 if report["runs_with_violations"] else 0


if __name__ == "__main__":
    from ppstate.cli_pipe import run_main
    sys.exit(run_main(main))
