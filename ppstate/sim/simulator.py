"""Deterministic discrete-event simulator of a ``pp_size``-stage pipeline running the real scheduler.

Logical integer ticks; one seed draws the whole workload (:mod:`ppstate.sim.workload`). Each rank
is a :class:`~ppstate.sim.rank.SimRank` (device state, CPU mirrors, PPHandler on non-last ranks).
Timing rules: rank r starts issued step s only after it finished its previous step, after rank r-1
finished s (the p2p hand-off of hidden states; rank 0: after the step was issued) and, on non-last
ranks, after the last rank finished every step <= s-depth whose deferred receive is still pending
(step s-depth itself, and those of numbers the scheduler skipped before s). A stage takes
``stage_base + stage_per_token * tokens`` ticks of work; with ``contention`` > 1 the stages share
the machine (processor sharing): while k of the pp_size ranks compute, each progresses at rate
``1 / (1 + (contention - 1) (k - 1) / (pp_size - 1))`` (the slow-down of
:meth:`ppstate.step_cost.StepCostModel.slowdown`), so overlapped mode pays for running its stages
at once as it does on a CPU whose cores the stages share. After every tick the
:class:`~ppstate.oracle.invariants.InvariantOracle` has seen all new facts.

Usage: ``python -m ppstate.sim --pp 4 --requests 64 --seed 1 --mode overlapped --json``
(see :mod:`ppstate.sim.cli`). Each rank runs the runtime's step order
(:class:`ppstate.rank_step.RankStep`) with :class:`~ppstate.sim.rank.SimRank` as its backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ppstate.events import NULL_SINK, EventSink
from ppstate.scheduler import RequestSpec, Scheduler
from ppstate.oracle.invariants import InvariantOracle
from ppstate.sim.rank import SimRank, Wire
from ppstate.oracle.model import EOS_TOKEN, SimRequest
from ppstate.sim.workload import SimConfig, make_workload


@dataclass
class SimResult:
    """Outcome of one run (the CLI's JSON object)."""
    steps: int
    ticks: int
    completed: int
    aborted: int
    output_tokens: int
    throughput_tokens_per_tick: float
    bubble_fraction: float
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    invariant_violations: list[dict] = field(default_factory=list)
    num_violations: int = 0
    seed: int = 0
    repro: str = ""
    #: speculative runs only (None otherwise, and left out of the CLI's JSON): the scheduler's
    #: ``spec_stats`` (drafts proposed and accepted, decode rows with drafts)
    spec: dict | None = None


class Simulator:
    """One run of ``cfg`` (use :func:`run_sim`); ``sink`` records the scheduler's events
    (:mod:`ppstate.sim.trace` writes them as a replayable trace)."""

    def __init__(self, cfg: SimConfig, sink: EventSink = NULL_SINK) -> None:
        self.cfg = cfg
        sc = cfg.scheduler
        self.sched = Scheduler(sc, sink=sink)
        self.requests = make_workload(cfg)
        self.arrivals = sorted(self.requests, key=lambda r: r.arrival)
        self.aborts = sorted((r.abort_at, r.req_id) for r in self.requests if r.abort_at >= 0)
        self.checker = InvariantOracle(self.requests, self.sched)
        depth = sc.pp_size if sc.mode == "overlapped" else 1
        self.depth = depth
        kv = (sc.max_model_len, sc.num_kv_blocks, sc.block_size)
        spec = (sc.num_spec_tokens, cfg.spec_acceptance)
        self.ranks = [SimRank(r, sc.pp_size, depth, sc.max_num_seqs, self.checker, kv, spec)
                      for r in range(sc.pp_size)]
        self.wire = Wire()
        self.outputs = self.wire.outputs
        self.issued: list[int] = []   # numbers of the issued steps, in order (skipped ones absent)
        self.now = 0
        self.num_aborted = 0
        self.output_tokens = 0
        self.max_steps = cfg.max_steps or self._step_bound()

    def _step_bound(self) -> int:
        work = sum(len(r.prompt) + r.max_tokens + 1 for r in self.requests)
        return (work + 16) * (self.cfg.scheduler.pp_size + 1) * 2

    # ---------------------------------------------------------------- events of one tick
    def _arrive(self) -> None:
        while self.arrivals and self.arrivals[0].arrival <= self.now:
            r: SimRequest = self.arrivals.pop(0)
            self.sched.add_request(RequestSpec(
                r.req_id, r.prompt, r.max_tokens, eos_token_ids=frozenset({EOS_TOKEN}),
                ignore_eos=r.ignore_eos, sampling={"seed": r.sample_seed, "eos_at": r.eos_at},
                fork_of=r.fork_of))
        while self.aborts and self.aborts[0][0] <= self.now:
            _, rid = self.aborts.pop(0)
            if rid in self.checker.closed or any(a.req_id == rid for a in self.arrivals):
                continue
            if self.sched.abort(rid):
                self.num_aborted += 1
                self.checker.on_abort(rid)

    def _complete(self) -> None:
        for rank in self.ranks:
            if rank.running is not None and rank.busy_until <= self.now:
                rank.finished[rank.running] = rank.busy_until
                rank.busy_ticks += rank.busy_until - rank.started - rank.planned  # contention
                rank.running = None

    def _issue(self) -> None:
        while (out := self.sched.schedule()) is not None:
            self.outputs[out.step] = out
            self.issued.append(out.step)
            self.checker.on_issue(out)

    def _next_of(self, rank: SimRank) -> int | None:
        """The issued step rank ``rank`` runs next, or None when it ran every issued step."""
        i = rank.next_index
        return self.issued[i] if i < len(self.issued) else None

    def _consumed_by(self, rank: SimRank, s: int) -> list[int]:
        """Steps whose pending deferred receive rank ``rank`` consumes in step ``s``."""
        if rank.handler is None:
            return []
        return [p for p in rank.handler.pending_steps() if p <= s - self.depth]

    def _can_start(self, rank: SimRank) -> bool:
        s = self._next_of(rank)
        if rank.running is not None or s is None:
            return False
        never = self.now + 1
        if rank.rank > 0 and \
                self.ranks[rank.rank - 1].finished.get(s, never) + self.cfg.p2p_ticks > self.now:
            return False
        last = self.ranks[-1].finished
        return all(last.get(p, never) + self.cfg.broadcast_ticks <= self.now
                   for p in self._consumed_by(rank, s))

    def _start_ranks(self) -> None:
        for rank in self.ranks:
            if not self._can_start(rank):
                continue
            out = self.outputs[self._next_of(rank)]
            result = rank.run_step(out, self.wire)
            dur = self.cfg.empty_step_ticks if out.num_rows == 0 and \
                self.cfg.empty_step_ticks >= 0 else self.cfg.stage_time(out.total_tokens)
            rank.running, rank.busy_until = out.step, self.now + dur
            rank.busy_ticks += dur
            rank.work_left, rank.started, rank.planned = float(dur), self.now, dur
            rank.next_index += 1
            if result is not None:
                self._pending_results.append((rank, out.step, result))

    def _charge_work(self) -> None:
        """Contention: charge the ticks since the last event to the running ranks' work."""
        if self.cfg.contention == 1.0:
            return
        dt = self.now - self._work_at
        if dt > 0:
            for r in self.ranks:
                if r.running is not None:
                    r.work_left -= dt / self._slow
        self._work_at = self.now

    def _retime(self) -> None:
        """Contention: end ticks of the running ranks at the slow-down of the ranks now running."""
        if self.cfg.contention == 1.0:
            return
        running = [r for r in self.ranks if r.running is not None]
        pp = len(self.ranks)
        k = len(running)
        self._slow = 1.0 if pp == 1 or k <= 1 else \
            1.0 + (self.cfg.contention - 1.0) * (k - 1) / (pp - 1)
        for r in running:
            r.busy_until = self.now + max(0, math.ceil(r.work_left * self._slow - 1e-9))

    def _deliver_results(self) -> None:
        while self._pending_results and \
                self._pending_results[0][0].finished.get(self._pending_results[0][1], self.now + 1) \
                <= self.now:
            _, _, result = self._pending_results.pop(0)
            updates = self.sched.on_step_result(result)
            self.output_tokens += sum(len(u.token_ids) for u in updates)
            self.checker.on_updates(result.step, updates)

    def _next_time(self) -> int | None:
        times = [r.busy_until for r in self.ranks if r.running is not None]
        times += [t for t in self._waits() if t > self.now]
        if self.arrivals:
            times.append(self.arrivals[0].arrival)
        if self.aborts:
            times.append(self.aborts[0][0])
        return min(times) if times else None

    def _waits(self) -> list[int]:
        """Ticks at which a latency (p2p hand-off, broadcast) ends for an idle rank's next step."""
        out = []
        for rank in self.ranks:
            s = self._next_of(rank)
            if rank.running is not None or s is None:
                continue
            if rank.rank > 0 and s in self.ranks[rank.rank - 1].finished:
                out.append(self.ranks[rank.rank - 1].finished[s] + self.cfg.p2p_ticks)
            last = self.ranks[-1].finished
            out += [last[p] + self.cfg.broadcast_ticks for p in self._consumed_by(rank, s)
                    if p in last]
        return out

    # ---------------------------------------------------------------- main loop
    def run(self) -> SimResult:
        self._pending_results: list = []
        self._work_at = 0       # tick up to which the running ranks' work was charged
        self._slow = 1.0        # slow-down while the current set of ranks computes
        stuck = None
        while True:
            self._charge_work()
            self._complete()
            self._deliver_results()
            self._arrive()
            self._issue()
            self._start_ranks()
            self._retime()
            if self.sched.next_step > self.max_steps:
                stuck = f"no progress bound: {self.sched.next_step} steps > {self.max_steps}"
                break
            nxt = self._next_time()
            if nxt is None:
                break
            self.now = max(nxt, self.now)
        if stuck is None and (self.sched.has_unfinished() or self.sched.in_flight):
            stuck = (f"deadlock at tick {self.now}: {self.sched.num_running} running, "
                     f"{self.sched.num_waiting} waiting, {self.sched.in_flight} steps in flight")
        self.checker.finish(self.sched.next_step, stuck)
        return self._result()

    def _result(self) -> SimResult:
        ticks = max([max(r.finished.values(), default=0) for r in self.ranks] + [1])
        busy = sum(r.busy_ticks for r in self.ranks)
        completed = sum(1 for v in self.checker.closed.values() if v != "abort")
        return SimResult(
            steps=len(self.issued), ticks=ticks, completed=completed,
            aborted=self.num_aborted, output_tokens=self.output_tokens,
            throughput_tokens_per_tick=round(self.output_tokens / ticks, 6),
            bubble_fraction=round(1.0 - busy / (self.cfg.scheduler.pp_size * ticks), 6),
            preemptions=self.sched.num_preemptions,
            prefix_hit_tokens=self.sched.kv.pool.hit_tokens,
            invariant_violations=[v.as_dict() for v in self.checker.violations],
            num_violations=self.checker.num_violations, seed=self.cfg.seed,
            repro=repro_command(self.cfg),
            spec=self.sched.spec_stats() if self.cfg.scheduler.num_spec_tokens else None)


def run_sim(cfg: SimConfig) -> SimResult:
    """Run one deterministic simulation of ``cfg``."""
    return Simulator(cfg).run()


def repro_command(cfg: SimConfig, json_out: bool = True) -> str:
    """The CLI line that reproduces a run of ``cfg`` (random workloads only; every flag spelt
    out, ``--json`` at the end unless ``json_out`` is False)."""
    sc = cfg.scheduler
    default_blocks = sc.max_num_seqs * -(-sc.max_model_len // sc.block_size)  # --kv-blocks unset
    return (f"python -m ppstate.sim --pp {sc.pp_size} --requests {cfg.num_requests} "
            f"--seed {cfg.seed} --mode {sc.mode} --prompt-len {cfg.prompt_len[0]}:"
            f"{cfg.prompt_len[1]} --output-len {cfg.output_len[0]}:{cfg.output_len[1]} "
            f"--chunk {sc.max_prefill_chunk} --abort-rate {cfg.abort_rate} --arrival {cfg.arrival} "
            f"--max-num-seqs {sc.max_num_seqs} --max-num-batched-tokens "
            f"{sc.max_num_batched_tokens} --eos-prob {cfg.eos_prob} --stage-cost "
            f"{cfg.stage_base}:{cfg.stage_per_token} --p2p-ticks {cfg.p2p_ticks} --broadcast-ticks "
            f"{cfg.broadcast_ticks} --block-size {sc.block_size}"
            + (f" --kv-blocks {sc.num_kv_blocks}" if sc.num_kv_blocks != default_blocks else "")
            + (f" --max-model-len {sc.max_model_len}" if sc.max_model_len != 2048 else "")
            + f" --shared-prefix {cfg.shared_prefix}"
            + (f" --fork-rate {cfg.fork_rate}" if cfg.fork_rate else "")
            + ("" if sc.enable_prefix_caching else " --no-prefix-caching")
            + (f" --contention {cfg.contention}" if cfg.contention != 1.0 else "")
            + (f" --empty-step-ticks {cfg.empty_step_ticks}" if cfg.empty_step_ticks >= 0 else "")
            + (" --adaptive-lanes" if sc.adaptive_lanes else "")
            + (f" --spec-tokens {sc.num_spec_tokens} --spec-acceptance {cfg.spec_acceptance}"
               if sc.num_spec_tokens else "") + (" --json" if json_out else ""))
