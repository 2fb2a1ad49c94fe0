"""``python -m runtime.bench mirror``: host time per step of a rank's mirror validation, on / off.

For each ``--rows`` count N, one rank's :class:`~runtime.worker.device_state.DeviceState` on
``--device`` holds N decoding requests (``--prompt-len`` tokens, blocks of 16, every slot live),
and a step runs what the worker runs around the model for N decode rows: the block-table deltas of
the rows that cross a block, the immediate and the sampled post-update (device kernels and CPU
mirror). With validation on, the step also runs everything ``--validate-mirrors every`` adds: the
block-id digest check of the step's rows against the scheduler's digests (before the forward) and
the after-step check (on CUDA :class:`~runtime.worker.mirror_check.AsyncMirrorCheck`: the expected
values copied to the device, compared there with the device tables, one flag copied back; on the
CPU ``DeviceState.validate``).

Off, on and the check as it was at ``--before-rev`` (default 2bc6e7d, main before the check moved the block digest onto the device; before that 4e816c2, main before the last rank's
check rode on its result copy; :mod:`runtime.worker.mirror_check` and
:mod:`runtime.worker.token_check` read from git at run time, :mod:`runtime.bench.git_source`, or
from ``--before-dir`` where the machine has no ``.git``; same coverage; reported as ``before_*``)
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
as it was before issue #27 (the mirror counters only), in the same run. The share of a whole
engine step is smaller by the model's time (the engine on / off ratio: ``runtime.bench pp
--overheads``). ``--json-out F`` writes the results (kind ``mirror-validation``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from ppstate.batch import NewRequest, SchedulerOutput
from ppstate.block_digest import BlockDigests
from ppstate.mirror import MIRROR_FIELDS
from runtime.bench.git_source import SourceUnavailable, load_module
from runtime.bench.mirror_profile import graph_gpu_us, profile_modes
from runtime.bench.results import subcommand_line, write_result
from runtime.host_copy import HostCopy
from runtime.worker.device_state import DeviceState
from runtime.worker.mirror_check import AsyncMirrorCheck

BLOCK = 16
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


class RankLoop:
    """One rank's per-step state work for ``rows`` decode rows (no model)."""

    def __init__(self, rows: int, device: torch.device, prompt_len: int, max_model_len: int,
                 before: tuple[type, type] | None = None) -> None:
        """``before``: :func:`before_classes` (None: no ``"before"`` mode)."""
        self.n, self.device = rows, device
        self.state = DeviceState(rows, max_model_len, 1, device, rank=0, block_size=BLOCK)
        self.state.add_requests([NewRequest(f"r{s}", s, tuple(range(100, 100 + prompt_len)),
                                            max_model_len) for s in range(rows)])
        self.digests = BlockDigests(rows, -(-max_model_len // BLOCK))
        self.next_block = 0
        self.tokens = np.full(rows, prompt_len, dtype=np.int64)   # [rows] computed tokens
        self.held = np.zeros(rows, dtype=np.int64)                # [rows] blocks
        self.slots = np.arange(rows, dtype=np.int32)
        self.slots_t = torch.arange(rows, device=device)
        self.ones_t = torch.ones(rows, dtype=torch.int64, device=device)
        self.zeros_t = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampled = torch.full((rows, 1), 7, dtype=torch.int64, device=device)
        self.state.mirror.num_computed_tokens_np[:] = 0
        self._grow(self.tokens)                                   # the prompts' blocks
        self.state.apply_scheduled(self.slots_t, torch.full((rows,), prompt_len, device=device),
                                   self.slots.astype(np.int64), self.tokens.copy())
        cuda = device.type == "cuda"
        self.check = AsyncMirrorCheck(self.state) if cuda else None
        self.before = self.before_tokens = None   # "before" blocks only
        if before is not None:
            self.before = before[0](self.state) if cuda else None
            self.before_tokens = before[1](rows, max_model_len, device)
        self.token_mirror = self.state.track_tokens()   # the token-id check: "on" blocks only
        self.state.tokens = None
        self.copies = HostCopy(device)   # the last rank's result copy (every mode)
        self.held_copy = None   # the previous step's result copy, waited after the next step
        self.clock = time.perf_counter if device.type == "cuda" else time.process_time
        self.check_s = 0.0   # time spent inside the validation calls (both kinds), summed
        self.step_no = 0

    def _grow(self, need_tokens: np.ndarray) -> np.ndarray:
        """Deltas giving each slot blocks for ``need_tokens`` ``[rows]``; returns the slots."""
        need = -(-need_tokens // BLOCK)
        grow = np.flatnonzero(need > self.held)
        slots, cols = [], []
        for s in grow.tolist():
            for c in range(int(self.held[s]), int(need[s])):
                slots.append(s)
                cols.append(c)
        s_a, c_a = np.array(slots, dtype=np.int32), np.array(cols, dtype=np.int32)
        ids = np.arange(self.next_block, self.next_block + len(slots), dtype=np.int32)
        self.next_block += len(slots)
        self.held[grow] = need[grow]
        self.digests.apply([], s_a, c_a, ids)
        self.state.apply_block_updates(s_a, c_a, ids)
        return grow

    def step(self, validate: bool | str) -> None:
        """One decode step of every row (what the worker does besides the model). ``validate``:
        False, True (everything), ``"before"`` (everything, as at the before revision:
        :func:`before_classes`) or ``"counters"`` (CPU: only the mirror counters'
        check, as before issue #27: the stacked read, ``CpuMirror.validate`` and
        ``validate_blocks``)."""
        self._grow(self.tokens + 1)
        st = self.state
        out = SchedulerOutput(self.step_no, (), self.slots, np.ones(self.n, dtype=np.int32),
                              self.tokens.astype(np.int32), np.ones(self.n, dtype=bool),
                              block_digests=self.digests.of(self.slots))
        t0 = self.clock()
        if validate is True and self.check is not None:
            self.check.expect_digests(out)   # compared on the device by the step's snapshot
        elif validate is True or validate == "before":
            st.check_block_digests(out)
        self.check_s += self.clock() - t0
        slots64 = self.slots.astype(np.int64)
        st.apply_scheduled(self.slots_t, self.ones_t, slots64, np.ones(self.n, dtype=np.int64))
        st.apply_sampled(self.slots_t, self.sampled, self.ones_t, self.zeros_t, slots64,
                         np.zeros(self.n, dtype=np.int64), np.ones(self.n, dtype=np.int64),
                         tokens_later=validate is True and self.check is not None)
        self.tokens += 1
        t0 = self.clock()
        self.tail(validate, self.step_no)
        self.check_s += self.clock() - t0
        self.step_no += 1

    def tail(self, validate: bool | str, step: int) -> None:
        """What follows a step's post-update on the last rank: the after-step check of
        ``validate`` (:meth:`after_step`), the result copy, and the wait for the previous
        step's copy (the worker's flush, after the next step was enqueued)."""
        copy = self.after_step(validate, step)
        prev, self.held_copy = self.held_copy, copy
        if prev is not None:
            prev.wait()

    def after_step(self, validate: bool | str, step: int):
        """The after-step check of ``step`` (off: none; True: now, riding on the result copy on
        CUDA; ``"before"``: as at the before revision; ``"counters"``: CPU, the mirror counters
        only) and the result copy; returns the copy (a PendingCopy)."""
        st = self.state
        if validate == "counters":
            live = st.live_slots()
            dev = torch.stack([getattr(st, f) for f in MIRROR_FIELDS]).cpu().numpy()
            st.mirror.validate(dev, live, step, owners=st.owner)
            st.mirror.validate_blocks(BLOCK, live, step, owners=st.owner)
        elif validate and self.check is None:
            st.validate(step)
        elif validate == "before":
            self.before.snapshot(step)
        elif validate:
            self.check.snapshot(step, later=True)
        copy = self.copies.start(self.sampled)
        if validate is True and self.check is not None:
            st.tokens.attach(copy.host)
            self.check.share(copy)
        return copy

    def use(self, validate: bool | str) -> None:
        """Install the token mirror of mode ``validate`` (none when off), from the device's ids."""
        st = self.state
        st.tokens = None
        if validate is True:
            st.tokens = self.token_mirror
        elif validate == "before":
            if self.before_tokens is None:
                raise ValueError("RankLoop built without before classes: no 'before' mode")
            st.tokens = self.before_tokens
        if st.tokens is not None:
            st.tokens.resync(st.all_token_ids)

    def finish(self) -> None:
        """Compare what is still pending (CUDA) and wait for the last result copy."""
        for check in (self.check, self.before):
            if check is not None:
                check.poll(block=True)
        if self.held_copy is not None:
            self.held_copy.wait()
            self.held_copy = None

    def block(self, steps: int, validate: bool | str) -> float:
        """Seconds per step of ``steps`` steps: wall time on CUDA (synchronised at the end),
        process CPU time on the CPU (the neighbours' load does not count). Also sets
        ``inside_s``: seconds per step spent inside the validation calls themselves."""
        self.check_s = 0.0
        cuda = self.device.type == "cuda"
        self.use(validate)
        clock = time.perf_counter if cuda else time.process_time
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(steps):
            self.step(validate)
        t1 = self.clock()
        self.finish()
        self.check_s += self.clock() - t1
        self.inside_s = self.check_s / steps   # the last compares included (poll)
        if cuda:
            torch.cuda.synchronize()
        return (clock() - t0) / steps


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
            before_cls: tuple[type, type], profile: bool = False) -> dict:
    """Off / on / before alternated ``rounds`` times at ``rows`` rows (module docstring;
    ``before_cls``: :func:`before_classes`; ``profile``: also :func:`profile_modes`)."""
    max_model_len = prompt_len + (4 * rounds + 2 + 6 * profile) * steps + 2 * BLOCK
    loop = RankLoop(rows, torch.device(device), prompt_len, max_model_len, before_cls)
    loop.block(steps, True)                     # warm-up (allocations, first kernels)
    loop.block(steps, "before")
    off, on, before, counters, inside_on, inside_before = [], [], [], [], [], []
    inside_off = []
    for _ in range(rounds):
        off.append(loop.block(steps, False))
        inside_off.append(loop.inside_s)
        on.append(loop.block(steps, True))
        inside_on.append(loop.inside_s)
        before.append(loop.block(steps, "before"))
        inside_before.append(loop.inside_s)
        if device == "cpu":
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
    res["pieces_us"] = pieces(loop)
    if device == "cuda":   # the device time of the check's graph alone, now and before
        res["check_graph_gpu_us"] = graph_gpu_us(loop.check)
        res["before_check_graph_gpu_us"] = graph_gpu_us(loop.before)
    if profile:
        res["profile"] = profile_modes(loop, steps)
    if counters:   # the check before issue #27 (mirror counters only), same run
        res["counters_only_us_per_step"] = 1e6 * (statistics.median(counters) -
                                                  statistics.median(off))
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench mirror", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="128,256", help="comma list of decode rows (live slots)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=100, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=5, help="off / on pairs")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--before-rev", default=BEFORE_REV,
                   help="git revision whose mirror_check.py / token_check.py are 'before'")
    p.add_argument("--before-dir", default=None,
                   help="folder with mirror_check.py and token_check.py of --before-rev, "
                        "extracted beforehand (a machine without the repository's .git)")
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
    if args.device == "cpu":
        torch.set_num_threads(1)
    results = []
    for n in rows:
        r = measure(n, args.device, args.steps, args.rounds, args.prompt_len, before_cls,
                    args.profile)
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
        if r.get("check_graph_gpu_us") is not None:
            print(f"  check graph on the device alone: {r['check_graph_gpu_us']:.1f} us now, "
                  f"{r['before_check_graph_gpu_us'] or float('nan'):.1f} us before", flush=True)
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
