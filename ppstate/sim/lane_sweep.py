"""Noise-free check of the lane policy: decode throughput by concurrency, sync vs overlapped
(all lanes) vs overlapped with adaptive lanes, in the simulator.

The simulator's stage time is the lane policy's step-cost model, exactly: ``base + per_token x
tokens`` ticks per stage step, stages slowed down by ``contention`` while they compute at once
(processor sharing, :mod:`ppstate.sim.simulator`), steps without rows cost ``empty`` ticks. The
scheduler gets the same coefficients (``cost_base_s = base`` ..., ``cost_concurrency =
contention``; ticks stand in for seconds), so any point where adaptive lanes lose to sync is a
fault of the policy, not of the calibration or of noise. ``--policy-contention`` gives the policy
another slow-down than the simulated one: a stale calibration (the machine's load changed since).
A burst of ``n`` requests (``prompt_len``-token prompts, ``max_tokens`` new tokens, no EOS) at
each concurrency.

``python -m ppstate.sim.lane_sweep --pp 2 --base 60 --per-token 1 --contention 1.8`` prints one
row per concurrency (JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import math

from ppstate.lanes import choose_lanes
from ppstate.sim.simulator import Simulator
from ppstate.oracle.model import SimRequest
from ppstate.sim.workload import SimConfig

MODES = {"sync": {"mode": "sync"}, "overlapped": {"mode": "overlapped"},
         "adaptive": {"mode": "overlapped", "adaptive_lanes": True}}


def burst(n: int, prompt_len: int, max_tokens: int) -> tuple[SimRequest, ...]:
    """``n`` requests at tick 0, distinct prompts (no prefix-cache hits), no EOS, no abort."""
    return tuple(SimRequest(f"r{i}", 0, tuple(1000 + 97 * i + j for j in range(prompt_len)),
                            max_tokens, i + 1, -1, True, -1) for i in range(n))


def point(n: int, pp: int, base: int, per_token: int, contention: float, empty: int,
          prompt_len: int = 16, max_tokens: int = 16, policy_contention: float | None = None) -> dict:
    """Output tokens per tick of each mode for a burst of ``n`` requests, the lane count the
    adaptive scheduler ended on, and adaptive / sync, overlapped / sync. The lane policy's
    ``cost_concurrency`` is ``policy_contention`` (default: the simulated ``contention``)."""
    row: dict = {"concurrency": n}
    for name, upd in MODES.items():
        cfg = SimConfig(pp_size=pp, max_num_seqs=max(n, pp), max_num_batched_tokens=4096,
                        max_prefill_chunk=512, max_model_len=prompt_len + max_tokens + 8,
                        cost_base_s=float(base), cost_per_row_s=0.0,
                        cost_per_token_s=float(per_token), cost_per_prefix_token_s=0.0,
                        cost_concurrency=contention if policy_contention is None
                        else policy_contention, stage_base=base, stage_per_token=per_token,
                        contention=contention, empty_step_ticks=empty,
                        workload=burst(n, prompt_len, max_tokens), **upd)
        sim = Simulator(cfg)
        res = sim.run()
        if res.invariant_violations or res.completed != n:
            raise RuntimeError(f"{name} at {n}: {res.invariant_violations[:3]} "
                               f"({res.completed} of {n} completed)")
        row[name] = res.throughput_tokens_per_tick
        if name == "adaptive":   # the lane count of the decode phase (all n requests live)
            row["lanes"] = choose_lanes(cfg.scheduler, n)
    row["adaptive_over_sync"] = row["adaptive"] / row["sync"]
    row["overlapped_over_sync"] = row["overlapped"] / row["sync"]
    return row


def _first_out_of_range(ns: argparse.Namespace, points: list[int]) -> str | None:
    """The message naming the first flag out of its range (NaN and infinity are out of every
    range), or None."""
    policy = 1.0 if ns.policy_contention is None else ns.policy_contention
    bounds = [("--pp", ns.pp, 2), ("--points", min(points), 1), ("--base", ns.base, 0),
              ("--per-token", ns.per_token, 0), ("--empty", ns.empty, 0),
              ("--contention", ns.contention, 1), ("--policy-contention", policy, 1)]
    for flag, value, low in bounds:
        if not value >= low:
            return f"argument {flag}: must be >= {low}, got {value:g}"
        if not math.isfinite(value):
            return f"argument {flag}: must be finite, got {value:g}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ppstate.sim.lane_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--points", default="1,2,4,8,16,32,64", help="comma list of concurrencies")
    p.add_argument("--base", type=int, default=60, help="ticks per stage step")
    p.add_argument("--per-token", type=int, default=1, help="ticks per token of a stage step")
    p.add_argument("--contention", type=float, default=1.8,
                   help="slow-down of a stage while all stages compute at once")
    p.add_argument("--policy-contention", type=float, default=None,
                   help="slow-down the lane policy assumes (default: --contention)")
    p.add_argument("--empty", type=int, default=1, help="ticks of a step without rows")
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    try:
        points = [int(x) for x in ns.points.split(",")]
    except ValueError:
        p.error(f"--points must be a comma list of integers, got {ns.points!r}")
    policy = ns.policy_contention
    bad = _first_out_of_range(ns, points)
    if bad:
        p.error(bad)
    rows = [point(n, ns.pp, ns.base, ns.per_token, ns.contention, ns.empty,
                  policy_contention=policy) for n in points]
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("concurrency  sync  overlapped  adaptive  lanes  overlapped/sync  adaptive/sync")
    for r in rows:
        print(f"{r['concurrency']:11d}  {r['sync']:.4f}  {r['overlapped']:.4f}  {r['adaptive']:.4f}"
              f"  {r['lanes']:5d}  {r['overlapped_over_sync']:15.3f}  {r['adaptive_over_sync']:13.3f}")
    return 0


if __name__ == "__main__":
    from ppstate.cli_pipe import run_main
    raise SystemExit(run_main(main))
