"""Command line of the simulator: ``python -m ppstate.sim ... --json`` (``ppstate/sim/__main__.py``).

Prints one JSON object (or a text summary without ``--json``) with steps, ticks, completed,
aborted, output_tokens, throughput_tokens_per_tick, bubble_fraction and invariant_violations; the
text summary lists each violation on a line of its own (invariant number and title, step, rank,
slot and request where known, message; the first 50 are kept). On violations it writes the run's
trace (``--trace-dir``, default ``sim-traces/``), prints to stderr where, and the command that
reproduces the run: the user's own flags (text stays text), whose re-run reports the same
violations, and exits with status 1. ``python -m ppstate.replay`` of that trace re-derives the
scheduler's decisions and lists the violations the simulator recorded in it (the simulated ranks
are not in the trace). With ``--trace-dir`` every run is recorded.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict

from ppstate import mutants
from ppstate.sim import cli_args as arg
from ppstate.errors import PPStateError
from ppstate.oracle.invariants import describe
from ppstate.sim.simulator import run_sim
from ppstate.sim.trace import DEFAULT_SIM_TRACE_DIR, record_sim
from ppstate.sim.workload import SimConfig

#: ``--spec-acceptance`` when not given (SimConfig's own default)
DEFAULT_SPEC_ACCEPTANCE = SimConfig.spec_acceptance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ppstate.sim",
                                description="Deterministic pipeline-parallel scheduling simulator")
    p.add_argument("--pp", type=arg.positive, default=2, help="pipeline stages")
    p.add_argument("--requests", type=arg.positive, default=16, help="number of requests")
    p.add_argument("--seed", type=arg.non_negative, default=0)
    p.add_argument("--mode", choices=("overlapped", "sync"), default="overlapped")
    p.add_argument("--prompt-len", type=arg.length_range, default=(8, 32), metavar="A:B")
    p.add_argument("--output-len", type=arg.length_range, default=(8, 32), metavar="A:B")
    p.add_argument("--max-prefill-chunk", "--chunk", dest="chunk", type=arg.positive, default=32,
                   help="max prefill chunk (tokens); --chunk is an alias")
    p.add_argument("--abort-rate", type=arg.probability, default=0.0)
    p.add_argument("--arrival", choices=("burst", "poisson"), default="burst")
    p.add_argument("--max-num-seqs", type=arg.positive, default=64)
    p.add_argument("--max-num-batched-tokens", type=arg.positive, default=256)
    p.add_argument("--max-model-len", type=arg.positive, default=2048)
    p.add_argument("--eos-prob", type=arg.probability, default=0.3)
    p.add_argument("--stage-cost", type=arg.stage_cost, default=(1, 2), metavar="BASE:PER_TOKEN",
                   help="stage time of a batch = BASE + PER_TOKEN * tokens (ticks)")
    p.add_argument("--p2p-ticks", type=arg.non_negative, default=0,
                   help="rank-to-rank hand-off latency")
    p.add_argument("--contention", type=arg.slow_down, default=1.0,
                   help="slow-down of a stage while all stages compute at once (>= 1)")
    p.add_argument("--empty-step-ticks",
                   type=arg.at_least(-1, " (-1: the stage's base cost)"), default=-1,
                   help="ticks of a step without rows (-1: the stage's base cost)")
    p.add_argument("--adaptive-lanes", action="store_true",
                   help="overlapped: fill only the lanes the step-cost model says are faster")
    p.add_argument("--broadcast-ticks", type=arg.non_negative, default=0,
                   help="sampled-id broadcast latency")
    p.add_argument("--trace-dir", default=None, help="record the run as a replayable trace in a "
                   "new run-* directory here (a run with violations is always recorded, by "
                   "default under sim-traces/)")
    p.add_argument("--block-size", type=arg.positive, default=16, help="KV block size (tokens)")
    p.add_argument("--kv-blocks", type=arg.positive, default=None,
                   help="KV blocks (default: max_model_len per slot); few force preemptions")
    p.add_argument("--shared-prefix", type=arg.non_negative, default=0,
                   help="tokens of a common prefix in front of every prompt")
    p.add_argument("--fork-rate", type=arg.probability, default=0.0,
                   help="probability a request is a fork of the previous one (n > 1 samples)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--spec-tokens", type=arg.spec_tokens, default=0, metavar="K",
                   help="speculative decoding: up to K drafts per decode row (default 0: off)")
    p.add_argument("--spec-acceptance", type=arg.probability, default=None,
                   help="probability that a draft is the model's token (with --spec-tokens; "
                        "default 0.7)")
    p.add_argument("--mutant", choices=sorted(mutants.MUTANTS), default=None, metavar="NAME",
                   help="switch one known-bad variant on (python -m ppstate.check "
                        "--list-mutants), e.g. keep_rejected_draft with --spec-tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def config_from_args(ns: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed flags (raises SchedulerError on bad values)."""
    return SimConfig(pp_size=ns.pp, num_requests=ns.requests, seed=ns.seed, mode=ns.mode,
                     prompt_len=ns.prompt_len, output_len=ns.output_len, max_prefill_chunk=ns.chunk,
                     max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
                     max_model_len=ns.max_model_len, abort_rate=ns.abort_rate, arrival=ns.arrival,
                     eos_prob=ns.eos_prob, stage_base=ns.stage_cost[0],
                     stage_per_token=ns.stage_cost[1], p2p_ticks=ns.p2p_ticks,
                     broadcast_ticks=ns.broadcast_ticks, block_size=ns.block_size,
                     contention=ns.contention, empty_step_ticks=ns.empty_step_ticks,
                     adaptive_lanes=ns.adaptive_lanes,
                     # the lane policy's step-cost model = the simulator's stage time (ticks)
                     cost_base_s=float(ns.stage_cost[0]), cost_per_row_s=0.0,
                     cost_per_token_s=float(ns.stage_cost[1]), cost_per_prefix_token_s=0.0,
                     cost_concurrency=ns.contention,
                     num_kv_blocks=ns.kv_blocks, shared_prefix=ns.shared_prefix,
                     fork_rate=ns.fork_rate, num_spec_tokens=ns.spec_tokens,
                     spec_acceptance=(DEFAULT_SPEC_ACCEPTANCE if ns.spec_acceptance is None
                                      else ns.spec_acceptance),
                     enable_prefix_caching=not ns.no_prefix_caching)


#: mutants the simulator does not model: name -> why (the model checker does)
CHECKER_ONLY_MUTANTS = {
    "blocking_all_chunk_broadcast": "a rank waiting at once for the broadcast of the step it is "
                                    "computing is not modelled by the simulator's tick schedule",
    "grammar_on_rejected": "the simulator runs no grammar (structured output)",
}
#: mutants that break speculative decoding only: without --spec-tokens they change nothing
SPEC_MUTANTS = ("keep_rejected_draft", "no_rejected_correction")


def shared_prefix_error(ns: argparse.Namespace) -> str | None:
    """Why ``--shared-prefix`` cannot fit ``--max-model-len`` (None when it can): every prompt
    is the prefix and at least one token more (a huge prefix was drawn before any request was
    refused: a MemoryError traceback)."""
    if ns.shared_prefix < ns.max_model_len:
        return None
    return (f"argument --shared-prefix: must be < --max-model-len ({ns.max_model_len}): a prompt "
            f"is the prefix and at least 1 token more, got {ns.shared_prefix}")


def spec_acceptance_error(ns: argparse.Namespace) -> str | None:
    """Why ``--spec-acceptance`` is refused (None when it is not): without ``--spec-tokens K``
    no draft is proposed, so the flag would change nothing and the run would not be the one
    asked for."""
    if ns.spec_acceptance is None or ns.spec_tokens > 0:
        return None
    return ("argument --spec-acceptance: has no effect without speculative decoding; add "
            "--spec-tokens K (K >= 1)")


def mutant_error(ns: argparse.Namespace) -> str | None:
    """Why ``--mutant`` cannot be simulated as given (None when it can)."""
    m = ns.mutant
    if m in CHECKER_ONLY_MUTANTS:
        return (f"argument --mutant: {m} is not simulated ({CHECKER_ONLY_MUTANTS[m]}); "
                f"run the model checker: python -m ppstate.check --mutant {m}")
    if m in SPEC_MUTANTS and ns.spec_tokens <= 0:
        return (f"argument --mutant: {m} breaks speculative decoding only; add --spec-tokens K "
                f"(K >= 1), e.g. --spec-tokens 2")
    return None


def run_cli(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run, print; returns 0 clean, 1 on violations,
    2 on bad arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    ns = parser.parse_args(argv)
    if (why := shared_prefix_error(ns) or spec_acceptance_error(ns) or mutant_error(ns)) \
            is not None:
        parser.error(why)
    with mutants.enabled(*([ns.mutant] if ns.mutant else [])):
        return _run(ns, "python -m ppstate.sim" + (" " + shlex.join(argv) if argv else ""))


def _run(ns: argparse.Namespace, repro: str) -> int:
    """Run the parsed flags ``ns``; ``repro`` is the user's own command line."""
    trace = None
    try:
        cfg = config_from_args(ns)
        if ns.trace_dir:
            result, trace = record_sim(cfg, ns.trace_dir, repro)
        else:
            result = run_sim(cfg)
            if result.num_violations:  # deterministic: the same run again, recorded
                result, trace = record_sim(cfg, DEFAULT_SIM_TRACE_DIR, repro)
    except PPStateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if trace is not None and result.num_violations:
        print(f"trace written to {trace} (python -m ppstate.replay {trace} re-derives its "
              f"scheduler decisions and lists the violations recorded there; the simulated ranks "
              f"are not in the trace: the command below re-runs them)", file=sys.stderr)
    if ns.json:
        summary = asdict(result)
        if summary["spec"] is None:   # runs without speculation print what they always did
            del summary["spec"]
        print(json.dumps({**summary, "trace": None if trace is None else str(trace)},
                         sort_keys=True))
    else:
        print(f"steps={result.steps} ticks={result.ticks} completed={result.completed} "
              f"aborted={result.aborted} output_tokens={result.output_tokens} "
              f"throughput={result.throughput_tokens_per_tick:.4f} tok/tick "
              f"bubble={result.bubble_fraction:.3f} preemptions={result.preemptions} "
              f"prefix_hit_tokens={result.prefix_hit_tokens} violations={result.num_violations}")
        for v in result.invariant_violations:
            print(describe(v))
        if result.num_violations > len(result.invariant_violations):
            print(f"... {result.num_violations - len(result.invariant_violations)} more "
                  f"(the first {len(result.invariant_violations)} are kept)")
    if result.num_violations:
        print(f"invariant violations with seed {result.seed}; reproduce with:\n  {repro}",
              file=sys.stderr)
        return 1
    return 0
