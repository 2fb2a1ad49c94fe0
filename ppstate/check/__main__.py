"""``python -m ppstate.check``: bounded model checking of the real scheduler, PPHandlers, CPU
mirrors and rank step order (docs/checker.md).

Exit status: 0 when no violation was found, 1 on a violation (a counterexample trace is written
and named), 2 on a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys

from ppstate.check.counterexample import write_counterexample
from ppstate.check.explore import explore
from ppstate.check.world import CheckConfig
from ppstate.mutants import MUTANTS


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"{text!r}: want A:B with 1 <= A <= B")
    return lo_i, hi_i


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want an integer >= 1")
    return v


def _nonneg(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want an integer >= 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ppstate.check",
        description="Explore every interleaving of arrivals, aborts, EOS, result delivery and "
                    "pipeline progress within the bounds, on the real scheduler, PPHandlers and "
                    "mirrors; check the invariants in every state and deadlock freedom.")
    a = p.add_argument
    a("--pp", type=_positive, default=2, help="pipeline stages (default 2)")
    a("--pp-max", type=_positive, default=None,
      help="also check every pp_size from --pp up to this one")
    a("--requests", type=_positive, default=3, help="requests that arrive, in order (default 3)")
    a("--prompt-len", type=_range, default=(1, 4), metavar="A:B",
      help="every prompt length in A..B tokens is explored (default 1:4)")
    a("--max-tokens", type=_range, default=(1, 3), metavar="A:B",
      help="every max_tokens in A..B is explored (default 1:3)")
    a("--chunk", type=_positive, default=2, help="max_prefill_chunk in tokens (default 2)")
    a("--max-num-seqs", type=_positive, default=2, help="slots (default 2)")
    a("--max-num-batched-tokens", type=_positive, default=4,
      help="tokens per step (default 4)")
    a("--block-size", type=_positive, default=2, help="tokens per KV block (default 2)")
    a("--kv-blocks", type=_positive, default=None,
      help="KV blocks (default: room for every slot; fewer force preemption)")
    a("--mode", choices=("overlapped", "sync"), default="overlapped",
      help="schedule mode (default overlapped)")
    a("--abort-anywhere", action="store_true",
      help="any live request may be aborted in any state")
    a("--async", dest="async_engine", action="store_true",
      help="issuing a step is a choice too, interleaved with arrivals, aborts and results "
           "(default: the engine issues as soon as schedule() gives a step)")
    a("--adaptive-lanes", action="store_true",
      help="the scheduler fills only the lanes its step-cost model picks (one lane with one live "
           "request, all with two at pp 2): closed lanes skip their step numbers")
    a("--spec-tokens", type=_nonneg, default=0, metavar="K",
      help="each sampled decode row reports 0..K rejected speculative tokens (default 0)")
    a("--grammar", action="store_true",
      help="every request is grammar-constrained: check the last rank's matcher position "
           "against its accepted output tokens")
    a("--mutant", choices=sorted(MUTANTS), default=None, metavar="NAME",
      help="switch one known-bad variant on (see --list-mutants)")
    a("--list-mutants", action="store_true", help="print the mutants and exit")
    a("--no-por", dest="por", action="store_false",
      help="explore the order in which ranks run too (no partial-order reduction)")
    a("--no-canon", dest="canon", action="store_false",
      help="key states by their whole pickle instead of the canonical key (docs/checker.md)")
    a("--jobs", type=_positive, default=1, metavar="N",
      help="worker processes expanding each BFS level (default 1)")
    a("--progress", action="store_true",
      help="print a line per BFS level to stderr (states, transitions, seconds so far)")
    a("--max-states", type=_positive, default=2_000_000,
      help="stop after this many distinct states (the run is then incomplete)")
    a("--trace-dir", default="check-traces",
      help="where a counterexample run directory is written (default check-traces/)")
    a("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.list_mutants:
        for name, what in MUTANTS.items():
            print(f"{name}: {what}")
        return 0
    pp_max = ns.pp_max or ns.pp
    if pp_max < ns.pp:
        p.error(f"--pp-max: {pp_max} is below --pp {ns.pp}")
    if ns.mutant == "no_rejected_correction" and ns.spec_tokens == 0:
        p.error("--mutant no_rejected_correction needs --spec-tokens K >= 1 (a rejection to "
                "correct)")
    if ns.mutant == "keep_rejected_draft":   # device and mirror agree: only KV contents show it
        p.error("--mutant keep_rejected_draft is the simulator's (the checker does not model KV "
                "contents): python -m ppstate.sim --spec-tokens 2 --mutant keep_rejected_draft")
    if ns.mutant == "grammar_on_rejected" and not (ns.grammar and ns.spec_tokens):
        p.error("--mutant grammar_on_rejected needs --grammar and --spec-tokens K >= 1")
    runs, violations, counterexample = [], [], None
    for pp in range(ns.pp, pp_max + 1):
        cfg = CheckConfig(
            pp_size=pp, num_requests=ns.requests, prompt_len=ns.prompt_len,
            max_tokens=ns.max_tokens, chunk=ns.chunk, max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens, block_size=ns.block_size,
            num_kv_blocks=ns.kv_blocks, abort_anywhere=ns.abort_anywhere,
            async_engine=ns.async_engine, spec_tokens=ns.spec_tokens, grammar=ns.grammar,
            mode=ns.mode,
            por=ns.por, mutant=ns.mutant, adaptive_lanes=ns.adaptive_lanes)
        res = explore(cfg, max_states=ns.max_states, canon=ns.canon,
                      jobs=ns.jobs, progress=sys.stderr if ns.progress else None)
        if res.violations and counterexample is None:
            res.counterexample = str(write_counterexample(cfg, res.path, ns.trace_dir))
            counterexample = res.counterexample
        runs.append(res.as_dict())
        violations += [{**v, "pp_size": pp} for v in res.violations]
        if not ns.json:
            print(f"pp={pp}: states={res.states} transitions={res.transitions} depth={res.depth} "
                  f"complete={res.complete} seconds={res.seconds} cpu_seconds={res.cpu_seconds} "
                  f"violations={len(res.violations)}", flush=True)
        if res.violations:
            break
    out = {"states": sum(r["states"] for r in runs),
           "transitions": sum(r["transitions"] for r in runs),
           "depth": max(r["depth"] for r in runs), "complete": all(r["complete"] for r in runs),
           "seconds": round(sum(r["seconds"] for r in runs), 3),
           "cpu_seconds": round(sum(r["cpu_seconds"] for r in runs), 3),
           "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
           "peak_worker_rss_mb": max(r["peak_worker_rss_mb"] for r in runs),
           "violations": violations, "num_violations": len(violations),
           "counterexample": counterexample, "runs": runs}
    if ns.json:
        print(json.dumps(out))
    else:
        for v in violations:
            print(f"violation: invariant {v['invariant']} at step {v['step']} rank {v['rank']} "
                  f"(pp {v['pp_size']}): {v['message']}")
        if counterexample:
            print(f"counterexample: {counterexample} (python -m ppstate.replay {counterexample})")
    return 1 if violations else 0


if __name__ == "__main__":
    from ppstate.cli_pipe import run_main
    sys.exit(run_main(main))
