"""``python -m runtime.bench sched``: CPU time per step of the control plane, no model.

For each ``--live`` count N, a :class:`~ppstate.scheduler.Scheduler` (overlapped, ``--pp`` stages,
N slots) holds N decoding requests; each step runs everything the runtime runs around the model:
``Scheduler.schedule``, the lifecycle / slot / KV-block machines, on every rank the
:class:`~ppstate.pp_handler.PPHandler` consume / enqueue (non-last ranks) and the
:class:`~ppstate.mirror.CpuMirror` updates and validation (against a copied device stand-in, as
the worker compares with a host copy of the device arrays), and ``Scheduler.on_step_result`` with
one sampled token per row. Reported: microseconds of process CPU time per step (median of
``--repeats`` timed blocks of ``--steps`` steps; the CPU clock is read once per block, as it costs
hundreds of microseconds per read on some VMs), split into scheduler and ranks in proportion to
their wall time.
``--json-out F`` writes ``{"results": [{"live": N, "us_per_step": ...}, ...]}`` (+ date, machine,
command). Sources of the steps: runtime/engine.py and runtime/worker/runner.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.events import NULL_SINK, JsonlSink
from ppstate.mirror import CpuMirror
from ppstate.pp_handler import PPHandler, need_sampled_mask
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from runtime.bench.results import subcommand_line, write_result


class ControlPlane:
    """Scheduler + ``pp_size`` ranks' handlers and mirrors, driven one step at a time."""

    def __init__(self, live: int, pp_size: int, prompt_len: int = 16, max_model_len: int = 1024,
                 validate: bool = True, trace_dir: str | None = None) -> None:
        cfg = SchedulerConfig(pp_size=pp_size, max_num_seqs=live, max_num_batched_tokens=max(live, 64),
                              max_prefill_chunk=64, max_model_len=max_model_len)
        sinks = [NULL_SINK] * (pp_size + 1)
        if trace_dir is not None:  # the engine's and every rank's event file, as --trace-dir does
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            run = Path(tempfile.mkdtemp(prefix="sched-", dir=trace_dir))
            sinks = [JsonlSink(run / "engine.jsonl")] + [JsonlSink(run / f"rank{r}.jsonl")
                                                         for r in range(pp_size)]
        self.sched, self.pp, self.validate = Scheduler(cfg, sink=sinks[0]), pp_size, validate
        self.mirrors = [CpuMirror(live, rank=r) for r in range(pp_size)]
        self.handlers = [PPHandler(pp_size, live, sink=sinks[r + 1], rank=r)
                         for r in range(pp_size - 1)]
        self.owner: list[list[str | None]] = [[None] * live for _ in range(pp_size)]
        self.live = [np.zeros(live, dtype=bool) for _ in range(pp_size)]  # [max_num_reqs] each, as the worker's live_np
        for i in range(live):
            prompt = tuple(100 + (i * 7 + j) % 30000 for j in range(prompt_len))
            self.sched.add_request(RequestSpec(f"r{i}", prompt, max_tokens=max_model_len,
                                               eos_token_ids=frozenset()))
        self.sched_s = self.ranks_s = 0.0

    def _rank(self, r: int, out: SchedulerOutput) -> None:
        m, owner, live_np = self.mirrors[r], self.owner[r], self.live[r]
        if r < self.pp - 1:
            entry = self.handlers[r].consume()
            if entry is not None:
                m.apply_rejected(entry.idx_mapping, np.zeros(len(entry.idx_mapping), np.int64))
        for f in out.freed:
            owner[f.slot], live_np[f.slot] = None, False
            if r < self.pp - 1:
                self.handlers[r].on_slot_freed(f.slot, out.step)
        for n in out.new_requests:
            owner[n.slot], live_np[n.slot] = n.req_id, True
            m.add_request(n.slot, len(n.prompt_token_ids), n.max_seq_len, n.num_cached_tokens)
        m.apply_block_updates(out.block_table_slots, out.block_table_cols)
        m.apply_scheduled(out.slots.astype(np.int64), out.num_scheduled_tokens.astype(np.int64))
        if self.validate:
            live = live_np.nonzero()[0]
            device = m.values.copy()  # the host copy of the device arrays, stacked [F, max_num_reqs]
            m.validate(device, live, out.step, owners=owner)
            m.validate_blocks(self.sched.config.block_size, live, out.step, owners=owner)
        if r < self.pp - 1:
            mask = None if out.is_empty else need_sampled_mask(out)
            self.handlers[r].enqueue(out.step, out, mask, None)

    def step(self) -> bool:
        """Issue one step (or deliver the oldest result when the pipeline is full); False when
        nothing is left to do."""
        t0 = time.perf_counter()
        out = self.sched.schedule()
        t1 = time.perf_counter()
        if out is not None:
            for r in range(self.pp):
                self._rank(r, out)
        t2 = time.perf_counter()
        if out is None or self.sched.in_flight >= self.sched.config.in_flight_limit:
            if not self.sched.in_flight:
                return False
            o = self.sched.results.in_flight[0]
            n = o.num_rows
            self.sched.on_step_result(StepResult(o.step, np.full((n, 1), 7, np.int64),
                                                 o.is_final_chunk.astype(np.int32),
                                                 np.zeros(n, np.int32)))
        t3 = time.perf_counter()
        self.sched_s += (t1 - t0) + (t3 - t2)
        self.ranks_s += t2 - t1
        return True

    def warm_up(self) -> None:
        """Step until every request is admitted and decoding."""
        while self.sched.num_waiting or any(r.state == "prefilling"
                                            for r in self.sched.running_requests()):
            self.step()
        for _ in range(2 * self.pp + 2):
            self.step()


def measure(live: int, pp_size: int, steps: int, repeats: int, validate: bool = True,
            trace_dir: str | None = None) -> dict:
    """Per-step CPU microseconds for ``live`` decoding requests (median over ``repeats`` blocks);
    ``trace_dir``: with the scheduler's and PPHandlers' JSON-lines event files there."""
    # every request gets at most one token per step: room for all timed and warm-up steps
    plane = ControlPlane(live, pp_size, max_model_len=16 + steps * repeats + 8 * pp_size + 64,
                         validate=validate, trace_dir=trace_dir)
    plane.warm_up()
    blocks = []
    for _ in range(repeats):
        plane.sched_s = plane.ranks_s = 0.0
        first = plane.sched.next_step
        cpu0 = time.process_time()  # (slow on some VMs: read once per block only)
        for _ in range(steps):
            plane.step()
        cpu = time.process_time() - cpu0
        n = max(1, plane.sched.next_step - first)  # steps issued
        wall = plane.sched_s + plane.ranks_s   # wall split: scheduler vs ranks
        blocks.append((1e6 * cpu / n, 1e6 * cpu / n * plane.sched_s / wall,
                       1e6 * cpu / n * plane.ranks_s / wall))
    med = sorted(blocks)[len(blocks) // 2]
    return {"live": live, "pp_size": pp_size, "us_per_step": med[0], "scheduler_us_per_step": med[1],
            "ranks_us_per_step": med[2], "all_us_per_step": [b[0] for b in blocks],
            "steps_per_block": steps, "mirror_validation": validate, "traced": trace_dir is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench sched", description=__doc__)
    p.add_argument("--live", default="64,256,1024", help="comma list of live request counts")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks simulated)")
    p.add_argument("--steps", type=int, default=200, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks (median reported)")
    p.add_argument("--no-validate", action="store_true", help="mirror validation off")
    p.add_argument("--trace-dir", default=None, help="record the scheduler's and PPHandlers' "
                   "events there (the CPU cost of tracing)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    try:
        lives = [int(x) for x in args.live.split(",")]
    except ValueError:
        p.error(f"--live must be a comma list of integers, got {args.live!r}")
    if min(lives) < 1 or args.pp < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--live, --pp, --steps and --repeats must be >= 1")
    results = []
    for n in lives:
        res = measure(n, args.pp, args.steps, args.repeats, validate=not args.no_validate,
                      trace_dir=args.trace_dir)
        results.append(res)
        print(f"live {n:5d}: {res['us_per_step']:8.1f} us/step (scheduler "
              f"{res['scheduler_us_per_step']:.1f}, {args.pp} ranks {res['ranks_us_per_step']:.1f})",
              flush=True)
    if args.json_out:
        write_result(args.json_out, "sched", {"results": results}, vars(args),
                     subcommand_line("sched", argv))
    return 0
