"""``python -m runtime.bench mirror``: host time per step of a rank's mirror validation, on / off.

For each ``--rows`` count N, one rank's :class:`~runtime.worker.device_state.DeviceState` on
``--device`` holds N decoding requests (``--prompt-len`` tokens, blocks of 16, every slot live),
and a step runs what the worker runs around the model for N decode rows
(:class:`~runtime.bench.rank_loop.RankLoop`): the block-table deltas of the rows that cross a
block, the immediate and the sampled post-update (device kernels and CPU mirror). With
validation on, the step also runs everything ``--validate-mirrors every`` adds: the block-id
digests of the step's rows against the scheduler's (on CUDA with the after-step check, on the CPU
before the forward) and the after-step check (on CUDA
:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`: the expected values copied to the device,
compared there with the device tables, one flag copied back; on the CPU
``DeviceState.validate``).

Off, on and the check as it was at ``--before-rev`` (default 2bc6e7d: main before the digest
moved onto the device; :mod:`runtime.worker.mirror_check` and :mod:`runtime.worker.token_check`
read from git at run time, :mod:`runtime.bench.git_source`, or from ``--before-dir`` where the
machine has no ``.git``; same coverage; reported as ``before_*``; on CUDA it rides on the result
copy too when that revision can, ``share``, as on the last rank)
alternate in one run (``--rounds`` triples of ``--steps`` steps; CUDA: wall time, synchronised at
the end of each block; CPU: process CPU time, one torch thread). Every mode also does what the
last rank does anyway: the copy of the step's sampled ids to the host (its result) and, after the
next step was enqueued, the wait for it. Reported per N: microseconds per step off and on (median
over rounds), the validation's share ``on / off - 1`` and its microseconds per step (``on - off``,
and the time spent inside the post-step calls themselves beyond off's, ``check_us_per_step``:
less exposed to the load of a shared machine; on CUDA it includes the wait for the previous
step's copy), and each post-step part timed alone on the final state (``pieces_us``,
:func:`pieces`: the digest, the result copy alone, the after-step check with it now and before);
on the CPU (where only the token mirror differs from before) also the microseconds of the check
as it was before issue #27 (the mirror counters only), in the same run; on CUDA the device time
of the check's graph alone, now and before (``check_graph_gpu_us``), and the host time of one
``replay()`` of it and of small graphs of one node kind each (``replay_host_us``). On CUDA a fourth mode,
``fused`` (``--mirror-check-kernel fused``: the check's flag from one Triton kernel), alternates
with them (``fused_*``: its validation microseconds, ``fused_over_off``, ``fused_over_on`` =
fused / graph, ``fused_check_graph_gpu_us``, ``pieces_us.after_step_fused``). ``--profile`` adds, per
mode, the calls and own time per step that it adds to off, function by function
(:mod:`runtime.bench.mirror_profile`, cProfile). The share of a whole engine step is smaller by
the model's time (the engine on / off ratio: ``runtime.bench pp --overheads``). ``--json-out F``
writes the results (kind ``mirror-validation``).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from ppstate.batch import SchedulerOutput
from runtime.bench.git_source import SourceUnavailable, load_module
from runtime.bench.mirror_host import measure_host
from runtime.bench.mirror_profile import graph_gpu_us, profile_modes, replay_host_us
from runtime.bench.rank_loop import BLOCK, RankLoop
from runtime.bench.results import subcommand_line, write_result

BEFORE_REV = "2bc6e7d"


def before_classes(rev: str, src_dir: str | None = None) -> tuple[type, type]:
    """``(AsyncMirrorCheck, TokenMirror)`` as they were at ``rev`` (``src_dir``: a folder holding
    ``mirror_check.py`` and ``token_check.py`` extracted from it instead).

    Raises:
        SourceUnavailable: git, the commit or a file is absent (the message says how to extract
            them).
    """
    mc = load_module(rev, "runtime/worker/mirror_check.py", f"_mirror_check_at_{rev}", src_dir)
    tc = load_module(rev, "runtime/worker/token_check.py", f"_token_check_at_{rev}", src_dir)
    return mc.AsyncMirrorCheck, tc.TokenMirror


def pieces(loop: RankLoop, calls: int = 300, repeats: int = 5) -> dict:
    """Microseconds per call of each post-step part alone on the loop's current state (no state
    change between calls: the healthy path), interleaved; the minimum over ``repeats`` (the least
    disturbed by a shared machine's load). ``digest``: the block-id digest check (the same code in
    both modes); ``result_copy``: the result copy and the wait for the previous one alone (off);
    ``after_step_now`` / ``after_step_before``: the after-step check with them (:meth:`RankLoop.tail`),
    so the check's own cost is the difference to ``result_copy``."""
    st, step = loop.state, loop.step_no
    out = SchedulerOutput(step, (), loop.slots, np.ones(loop.n, dtype=np.int32),
                          loop.tokens.astype(np.int32), np.ones(loop.n, dtype=bool),
                          block_digests=loop.digests.of(loop.slots))
    fns = {"digest": (False, lambda: st.check_block_digests(out)),
           "result_copy": (False, lambda: loop.tail(False, step)),
           "after_step_now": (True, lambda: loop.tail(True, step)),
           "after_step_before": ("before", lambda: loop.tail("before", step))}
    if loop.fused is not None:
        fns["after_step_fused"] = ("fused", lambda: loop.tail("fused", step))
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, (mode, f) in fns.items():
            loop.use(mode)
            t0 = loop.clock()
            for _ in range(calls):
                f()
            loop.finish()
            best[k] = min(best[k], (loop.clock() - t0) / calls)
    return {k: 1e6 * v for k, v in best.items()}


def measure(rows: int, device: str, steps: int, rounds: int, prompt_len: int,
            before_cls: tuple[type, type], profile: bool = False,
            before_deferred: bool = False) -> dict:
    """Off / on / before alternated ``rounds`` times at ``rows`` rows (module docstring;
    ``before_cls``: :func:`before_classes`; ``profile``: also :func:`profile_modes`;
    ``before_deferred``: the before check's snapshot after the flush, ``RankLoop``)."""
    max_model_len = prompt_len + (4 * rounds + 3 + 8 * profile) * steps + 2 * BLOCK
    loop = RankLoop(rows, torch.device(device), prompt_len, max_model_len, before_cls,
                    before_deferred)
    loop.block(steps, True)                     # warm-up (allocations, first kernels)
    loop.block(steps, "before")
    cuda = device == "cuda"
    if cuda:
        loop.block(steps, "fused")             # warm-up: the Triton kernel's compile
    off, on, before, counters, inside_on, inside_before = [], [], [], [], [], []
    inside_off, fused, inside_fused = [], [], []
    for _ in range(rounds):
        off.append(loop.block(steps, False))
        inside_off.append(loop.inside_s)
        on.append(loop.block(steps, True))
        inside_on.append(loop.inside_s)
        before.append(loop.block(steps, "before"))
        inside_before.append(loop.inside_s)
        if cuda:   # --mirror-check-kernel fused
            fused.append(loop.block(steps, "fused"))
            inside_fused.append(loop.inside_s)
        else:
            counters.append(loop.block(steps, "counters"))
    ratios = [b / a for a, b in zip(off, on)]
    res = {"rows": rows, "device": device, "us_per_step_off": 1e6 * statistics.median(off),
           "us_per_step_on": 1e6 * statistics.median(on),
           "validation_us_per_step": 1e6 * (statistics.median(on) - statistics.median(off)),
           "on_over_off": statistics.median(ratios), "on_over_off_all": ratios,
           "before_us_per_step_on": 1e6 * statistics.median(before),
           "before_validation_us_per_step": 1e6 * (statistics.median(before) -
                                                   statistics.median(off)),
           "before_over_off": statistics.median([b / a for a, b in zip(off, before)]),
           "check_us_per_step": 1e6 * (statistics.median(inside_on) -
                                       statistics.median(inside_off)),
           "before_check_us_per_step": 1e6 * (statistics.median(inside_before) -
                                              statistics.median(inside_off)),
           "post_step_us_off": 1e6 * statistics.median(inside_off),
           "steps_per_block": steps, "rounds": rounds}
    if fused:
        med = statistics.median
        res.update(fused_us_per_step_on=1e6 * med(fused),
                   fused_validation_us_per_step=1e6 * (med(fused) - med(off)),
                   fused_over_off=med([b / a for a, b in zip(off, fused)]),
                   fused_over_on=med([b / a for a, b in zip(on, fused)]),
                   fused_check_us_per_step=1e6 * (med(inside_fused) - med(inside_off)))
    res["pieces_us"] = pieces(loop)
    if cuda:   # the device time of the check's graph alone: now (graph, fused) and before
        res["check_graph_gpu_us"] = graph_gpu_us(loop.check)
        res["fused_check_graph_gpu_us"] = graph_gpu_us(loop.fused)
        res["before_check_graph_gpu_us"] = graph_gpu_us(loop.before)
        res["replay_host_us"] = replay_host_us(loop.check)
        res["fused_replay_host_us"] = (replay_host_us(loop.fused) or {}).get("check_graph")
    if profile:
        res["profile"] = profile_modes(loop, steps, (False, True, "before", "fused") if cuda
                                       else (False, True, "before"))
    if counters:   # the check before issue #27 (mirror counters only), same run
        res["counters_only_us_per_step"] = 1e6 * (statistics.median(counters) -
                                                  statistics.median(off))
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench mirror", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="128,256", help="comma list of decode rows (live slots)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, or host (the CUDA check's host work on this CPU, device "
                        "calls faked: runtime/bench/mirror_host.py)")
    p.add_argument("--steps", type=int, default=100, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5, help="off / on pairs")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--before-rev", default=BEFORE_REV,
                   help="git revision whose mirror_check.py / token_check.py are 'before'")
    p.add_argument("--before-dir", default=None,
                   help="folder with mirror_check.py and token_check.py of --before-rev, "
                        "extracted beforehand (a machine without the repository's .git)")
    p.add_argument("--before-deferred", action="store_true",
                   help="the before revision's check takes its snapshot after the flush, as now "
                        "(a revision with StageRunner.run_deferred_check: 43918f7 on) instead of "
                        "riding on the result copy")
    p.add_argument("--profile", action="store_true",
                   help="also profile one block per mode call by call (cProfile; runtime/bench/"
                        "mirror_profile.py): what on and before add to off, per step")
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        rows = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be a comma list of integers, got {args.rows!r}")
    if min(rows) < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--rows, --steps and --rounds must be >= 1")
    try:
        before_cls = before_classes(args.before_rev, args.before_dir)
    except SourceUnavailable as exc:
        p.error(f"cannot load the 'before' check: {exc}")
    if args.device in ("cpu", "host"):
        torch.set_num_threads(1)
    results = []
    for n in rows:
        if args.device == "host":   # the CUDA check's host work on this CPU (mirror_host.py)
            r = measure_host(n, args.steps, args.rounds, args.prompt_len, before_cls)
            results.append(r)
            print(f"rows {n:4d}, the CUDA check's host work on this CPU: validation "
                  f"{r['validation_us_per_step']:.1f} us/step (quartiles "
                  f"{r['validation_us_quartiles'][0]:.1f} .. {r['validation_us_quartiles'][1]:.1f}),"
                  f" before ({args.before_rev}) {r['before_validation_us_per_step']:.1f} us/step "
                  f"(quartiles {r['before_validation_us_quartiles'][0]:.1f} .. "
                  f"{r['before_validation_us_quartiles'][1]:.1f}); now / before "
                  f"{r['on_over_before_validation']:.2f}; off {r['us_per_step_off']:.1f} us/step; "
                  f"calls per step added {r['calls_per_step_added']:.1f} now, "
                  f"{r['before_calls_per_step_added']:.1f} before",
                  flush=True)
            continue
        r = measure(n, args.device, args.steps, args.rounds, args.prompt_len, before_cls,
                    args.profile, args.before_deferred)
        results.append(r)
        before = (f", counters only {r['counters_only_us_per_step']:.1f} us"
                  if "counters_only_us_per_step" in r else "")
        print(f"rows {n:4d} on {args.device}: off {r['us_per_step_off']:.1f} us/step, on "
              f"{r['us_per_step_on']:.1f} us/step (validation {r['validation_us_per_step']:.1f} "
              f"us{before}, on/off {r['on_over_off']:.3f}; before ({args.before_rev}): validation "
              f"{r['before_validation_us_per_step']:.1f} us, on/off {r['before_over_off']:.3f}); "
              f"inside the post-step calls beyond off's: {r['check_us_per_step']:.1f} us now, "
              f"{r['before_check_us_per_step']:.1f} us before", flush=True)
        print("  each part alone (us per call): " +
              ", ".join(f"{k} {v:.1f}" for k, v in r["pieces_us"].items()), flush=True)
        if "fused_validation_us_per_step" in r:
            print(f"  fused kernel: validation {r['fused_validation_us_per_step']:.1f} us, "
                  f"fused/off {r['fused_over_off']:.3f}, fused/graph {r['fused_over_on']:.3f}, "
                  f"inside the calls {r['fused_check_us_per_step']:.1f} us", flush=True)
        if r.get("check_graph_gpu_us") is not None:
            print(f"  check graph on the device alone: {r['check_graph_gpu_us']:.1f} us now, "
                  f"{r['fused_check_graph_gpu_us'] or float('nan'):.1f} us fused, "
                  f"{r['before_check_graph_gpu_us'] or float('nan'):.1f} us before", flush=True)
        if r.get("replay_host_us"):
            print("  host us per replay(): " + ", ".join(
                f"{k} {v:.1f}" for k, v in r["replay_host_us"].items()) +
                f", fused check graph {r['fused_replay_host_us'] or float('nan'):.1f}", flush=True)
        for mode, prof in r.get("profile", {}).items():
            if isinstance(prof, dict):
                print(f"  profiled {mode}: {prof['total_us']:.0f} us own time per step (off "
                      f"{r['profile']['off_total_us']:.0f}); most added: " +
                      "; ".join(f"{c['call']} x{c['calls_per_step']:g} +{c['added_us']:.1f}"
                                for c in prof["added"][:12]), flush=True)
    if args.json_out:
        write_result(args.json_out, "mirror-validation", {"results": results}, vars(args),
                     subcommand_line("mirror", argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
