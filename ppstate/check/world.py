"""One state of the model checker: the real scheduler, ``pp_size`` ranks, the process groups, the
issued steps and results, and the monitor; plus the actions that move it.

Actions (the explorer's choices): a request arrives (every prompt length and ``max_tokens`` in
the bounds), a live request is aborted (``abort_anywhere``), the oldest result the last rank
produced reaches the scheduler (the pipeline's latency is arbitrary), and with ``async_engine``
the engine issues a step (its step loop may lag behind arrivals, aborts and results). After every
action the world *settles*: ranks run every step they can, and without ``async_engine`` the engine
issues every step ``schedule()`` gives, as its step loop does when woken. Ranks are a Kahn
network: each is deterministic given its input channels (steps, hidden states, broadcasts), so
the order in which they run changes no channel's contents, no decision and no reachable deadlock,
and running them eagerly only makes results available as early as possible (``--no-por``
explores rank order too). The last rank's sampling inside a settle is a choice point (EOS or not
per row, rejected tokens) answered by a :class:`~ppstate.check.choices.Chooser`.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import asdict, dataclass
from typing import Literal

from ppstate import mutants
from ppstate.batch import SchedulerOutput, StepResult
from ppstate.budget import SchedulerConfig
from ppstate.check import snapshot
from ppstate.check.choices import Chooser
from ppstate.check.comm import Blocked, Comm
from ppstate.check.monitor import Monitor, MonitorSink
from ppstate.check.rank import CheckRank
from ppstate.events import NULL_SINK, RecordingSink
from ppstate.scheduler import RequestSpec, Scheduler
from ppstate.oracle.model import EOS_TOKEN, FIRST_TOKEN


#: step-cost coefficients of ``--adaptive-lanes`` (:class:`ppstate.step_cost.StepCostModel`,
#: arbitrary units): a step costs 1 + 0.5 per row, a stage 1.1x slower while all compute. At
#: pp 2 one live request runs fastest in one lane (3 < 0.97 x 3.3), two in both lanes (4 > 3.2).
LANE_COSTS = {"cost_base_s": 1.0, "cost_per_row_s": 0.0, "cost_per_token_s": 0.5,
              "cost_per_prefix_token_s": 0.0, "cost_concurrency": 1.1}


@dataclass(frozen=True)
class CheckConfig:
    """Bounds of one model-checking run (CLI flags in brackets).

    Attributes:
        pp_size [--pp]: stages. num_requests [--requests]: requests that arrive, in order.
        prompt_len [--prompt-len A:B], max_tokens [--max-tokens A:B]: inclusive ranges (tokens);
            every value is explored for every request.
        chunk [--chunk]: max_prefill_chunk. max_num_seqs [--max-num-seqs]: slots.
        max_num_batched_tokens [--max-num-batched-tokens]. block_size [--block-size].
        num_kv_blocks [--kv-blocks]: KV blocks (None: room for every slot; few force preemption).
        abort_anywhere [--abort-anywhere]: any live request may be aborted in any state.
        async_engine [--async]: issuing a step is a choice too (interleaves freely with
            arrivals, aborts and results) instead of happening as soon as schedule() gives one.
        spec_tokens [--spec-tokens K]: each sampled decode row reports 0..K rejected tokens.
        grammar [--grammar]: every request is grammar-constrained: the last rank keeps each
            slot's matcher position, advanced by the emitted tokens only, rebuilt from the kept
            outputs on re-admission, and checks it equals the slot's accepted output tokens.
        mode [--mode]: overlapped or sync. por [--no-por]: explore rank order too when False.
        mutant [--mutant]: the mutant switched on (``ppstate.mutants``), or None.
        adaptive_lanes [--adaptive-lanes]: the scheduler fills only the lanes its step-cost
            model picks (:mod:`ppstate.lanes`), with :data:`LANE_COSTS`: one lane while one
            request is live, all lanes (pp 2; two of three at pp 3) with two, so arrivals and
            finishes switch the lane count, closed lanes skip their step numbers and the ranks
            rotate their PPHandlers over the skipped numbers.
    """
    pp_size: int = 2
    num_requests: int = 3
    prompt_len: tuple[int, int] = (1, 4)
    max_tokens: tuple[int, int] = (1, 3)
    chunk: int = 2
    max_num_seqs: int = 2
    max_num_batched_tokens: int = 4
    block_size: int = 2
    num_kv_blocks: int | None = None
    abort_anywhere: bool = False
    async_engine: bool = False
    spec_tokens: int = 0
    grammar: bool = False
    mode: Literal["overlapped", "sync"] = "overlapped"
    por: bool = True
    mutant: str | None = None
    adaptive_lanes: bool = False

    def scheduler_config(self) -> SchedulerConfig:
        lanes = dict(adaptive_lanes=True, **LANE_COSTS) if self.adaptive_lanes else {}
        return SchedulerConfig(
            pp_size=self.pp_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, max_prefill_chunk=self.chunk,
            max_model_len=self.prompt_len[1] + self.max_tokens[1] + 1, mode=self.mode,
            block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, **lanes)

    def as_dict(self) -> dict:
        return asdict(self)


snapshot.constant_type(CheckConfig)


class World:
    """One explored state (see the module docstring). ``record``: keep every event (traces)."""

    def __init__(self, cfg: CheckConfig, record: bool = False) -> None:
        self.cfg, self.pp_size = cfg, cfg.pp_size
        self.spec_tokens, self.block_size = cfg.spec_tokens, cfg.block_size
        self.sched_sink = RecordingSink() if record else NULL_SINK
        self.sched = Scheduler(cfg.scheduler_config(), sink=self.sched_sink)
        snapshot.share(self.sched.config)   # constants: pickles name them (snapshot.py)
        snapshot.share(cfg)
        self.monitor = Monitor(self.sched, self)
        self.comm = Comm(cfg.pp_size)
        overlapped = cfg.mode == "overlapped"
        cols = -(-self.sched.config.max_model_len // cfg.block_size)   # blocks per slot
        self.ranks = [CheckRank(r, cfg.pp_size, overlapped, cfg.max_num_seqs,
                                MonitorSink(self.monitor, record), cols)
                      for r in range(cfg.pp_size)]
        for rk in self.ranks:
            rk.world = self
        self.outputs: dict[int, SchedulerOutput] = {}   # issued steps still referenced
        self.results: deque[StepResult] = deque()       # produced by the last rank, undelivered
        self.arrived = 0
        self.chooser: Chooser | None = None
        self.draining = False
        work = cfg.num_requests * (cfg.prompt_len[1] + cfg.max_tokens[1] + 1)
        self.max_steps = (work + 4) * (cfg.pp_size + 1) * 2
        self.step_bound = True   # --no-canon: absolute steps, bounded; canonical: cycle check

    # ---------------------------------------------------------------- cloning
    def clone(self) -> "World":
        return snapshot.loads(snapshot.dumps(self))

    def __deepcopy__(self, memo: dict) -> "World":
        return self   # a rank's snapshot shares its world (see _attempt)

    @property
    def violations(self) -> list[dict]:
        return self.monitor.violations

    # ---------------------------------------------------------------- actions
    def actions(self) -> list[tuple]:
        """Environment (and, unsettled, engine / rank) actions enabled here."""
        cfg, acts = self.cfg, []
        if self.arrived < cfg.num_requests:
            acts += [("arrive", p, m) for p in range(cfg.prompt_len[0], cfg.prompt_len[1] + 1)
                     for m in range(cfg.max_tokens[0], cfg.max_tokens[1] + 1)]
        if cfg.abort_anywhere:
            acts += [("abort", f"r{i}") for i in range(self.arrived) if self.sched.is_live(f"r{i}")]
        if self.results:
            acts.append(("deliver",))
        if cfg.async_engine:
            acts.append(("issue",))        # disabled when schedule() returns None (no successor)
        if not cfg.por:
            acts += [("rank", r) for r in range(self.pp_size) if self._runnable(r)]
        return acts

    def apply(self, action: tuple, chooser: Chooser) -> bool:
        """Apply ``action`` and settle; False when it changed nothing (not enabled)."""
        self.chooser = chooser
        try:
            kind = action[0]
            if kind == "arrive":
                self._arrive(action[1], action[2])
            elif kind == "abort":
                # the request's own id object, not the action's equal copy: pickles memoize by
                # identity, so one state must not pickle two ways (canonical keys)
                req = self.sched.queues.live.get(action[1])
                rid = req.req_id if req is not None else action[1]
                if self.sched.abort(rid):
                    self.monitor.on_abort(rid)
            elif kind == "deliver":
                self._deliver()
            elif kind == "issue":
                if not self._issue():
                    return False
            elif kind == "rank":
                if not self._attempt(action[1]):
                    return False
            self.settle()
            return True
        finally:
            self.chooser = None

    def _arrive(self, prompt_len: int, max_tokens: int) -> None:
        i = self.arrived
        self.arrived += 1
        rid = f"r{i}"
        prompt = tuple(FIRST_TOKEN + 16 * i + j for j in range(prompt_len))  # no shared prefix
        self.monitor.on_arrival(rid, prompt_len, max_tokens, False)
        self.sched.add_request(RequestSpec(rid, prompt, max_tokens,
                                           eos_token_ids=frozenset({EOS_TOKEN}),
                                           sampling={"seed": i + 1}))

    def _issue(self) -> bool:
        out = self.sched.schedule()
        if out is None:
            return False
        self.outputs[out.step] = out
        self.monitor.on_issue(out)
        if self.step_bound and out.step > self.max_steps:
            self.monitor.violation(6, out.step, None, f"no progress: {out.step} steps issued, "
                                   f"bound {self.max_steps}")
        return True

    def _deliver(self) -> None:
        res = self.results.popleft()
        self.monitor.on_updates(res.step, self.sched.on_step_result(res))

    # ---------------------------------------------------------------- ranks
    def _next_out(self, rk: CheckRank) -> SchedulerOutput | None:
        """The issued step rank ``rk`` runs next (the first at or after its ``next_step``: the
        scheduler skips numbers of steps that would carry nothing), or None."""
        later = [s for s in self.outputs if s >= rk.next_step]
        return self.outputs[min(later)] if later else None

    def _runnable(self, r: int) -> bool:
        rk = self.ranks[r]
        return self._next_out(rk) is not None and not self._waiting(rk)

    def _waiting(self, rk: CheckRank) -> bool:
        """The rank's step in progress waits on an op that has not completed."""
        return rk.blocked_on is not None and not rk.blocked_on.done

    def _attempt(self, r: int) -> bool:
        """Run rank ``r``'s next step; on a block keep the ops it issued and roll the rest back.
        True when something changed."""
        rk = self.ranks[r]
        out = self._next_out(rk)
        if out is None or self._waiting(rk):
            return False
        before = copy.deepcopy(rk) if self._may_block(rk, out) else None   # shares the world,
        n_events, n_ops = len(rk.sink.events), len(rk.oplog)             # its sink and the ops
        rk.begin_attempt(out.step)
        try:
            result = rk.step_order.step(out)
        except Blocked as b:
            if before is None:
                raise AssertionError(f"rank {r} blocked in step {out.step} although "
                                     f"_may_block said it cannot") from None
            before.oplog, before.choice_log, before.blocked_on = rk.oplog, rk.choice_log, b.op
            self.ranks[r] = before
            del rk.sink.events[n_events:]
            self._drain_mismatches()
            return len(before.oplog) > n_ops
        rk.finish_step()
        if result is not None:
            self.results.append(result)
        self._drain_mismatches()
        self._prune()
        return True

    def _may_block(self, rk: CheckRank, out: SchedulerOutput) -> bool:
        """Can rank ``rk``'s step ``out`` block? False only when it surely completes, so the
        rollback copy is skipped (most steps do not block). A step's waits, in order: the
        deferred receives its PPHandler consumes first (issued in earlier steps: one per number
        skipped before ``out`` and one for ``out``; each blocks iff its op is not done), and on
        ranks > 0 with rows the hidden-state receive, the first op the step issues on the ``pp``
        group (it completes at issue iff this rank's ``pp`` queue is empty and the previous
        rank's head is the matching send). With a mutant on: True."""
        if mutants.any_active():
            return True
        h = rk.handler
        if h is not None:
            for entry in list(h._fifo)[:out.step - rk.next_step + 1]:
                op = getattr(getattr(entry, "handle", None), "op", None)
                if entry is not None and (op is None or not op.done):
                    return True
        if rk.rank == 0 or out.num_rows == 0:
            return False
        if rk.oplog:                               # re-run: the receive was issued already
            return not rk.oplog[0].done
        comm = self.comm
        if comm.queues.get(("pp", rk.rank)):
            return True
        head = comm.head("pp", rk.rank - 1)
        index = comm.p2p_count.get(("pp", rk.rank - 1, rk.rank, "recv"), 0)
        return not (head is not None and head.kind == "send" and head.peer == rk.rank
                    and head.index == index)

    def _drain_mismatches(self) -> None:
        for msg, step in self.comm.take_mismatches():
            self.monitor.on_mismatch(msg, step)

    def _prune(self) -> None:
        low = min(rk.next_step for rk in self.ranks) - self.pp_size - 1
        for s in [s for s in self.outputs if s < low]:
            del self.outputs[s]
        rows = self.monitor.inner.row_admission
        for key in [k for k in rows if k[0] < low]:
            del rows[key]

    def run_ranks(self) -> bool:
        """Run ranks until none can move; True when any did."""
        moved_any, moved = False, True
        while moved:
            moved = False
            for r in range(self.pp_size):
                while self._attempt(r):
                    moved = moved_any = True
                    if self.violations and not self.draining:
                        return True
        return moved_any

    def drain(self) -> None:
        """Run to the end without further choices (no EOS, no rejection, no abort): ranks run,
        every result is delivered, steps are issued up to the step bound, also past violations.
        A counterexample trace ends this way, so it shows the whole effect of the bug."""
        self.draining, self.chooser = True, Chooser()
        moved = True
        while moved:
            moved = self.run_ranks()
            while self.results:
                self._deliver()
                moved = True
            while self.sched.next_step <= self.max_steps and self._issue():
                moved = True
        self.draining, self.chooser = False, None

    def settle(self) -> None:
        """Run everything that needs no choice of the explorer (see the module docstring)."""
        while not self.violations:
            moved = self.run_ranks() if self.cfg.por else False
            if not self.cfg.async_engine:
                while not self.violations and self._issue():
                    moved = True
            if not moved:
                return

    # ---------------------------------------------------------------- end states
    def unfinished(self) -> bool:
        """Work is left: live requests, steps in flight, ranks behind or ops pending."""
        return bool(self.sched.has_unfinished() or self.sched.in_flight or self.results or
                    any(rk.next_step < self.sched.next_step for rk in self.ranks) or
                    self.comm.pending())

    def describe_stuck(self) -> str:
        """What each blocked rank waits for, for a deadlock report."""
        parts = []
        for rk in self.ranks:
            if rk.blocked_on is not None and not rk.blocked_on.done:
                parts.append(f"rank {rk.rank} in step {self._next_out(rk).step} waits for "
                             f"{rk.blocked_on.describe()}")
            elif (nxt := self._next_out(rk)) is not None:
                parts.append(f"rank {rk.rank} idle before step {nxt.step}")
        return (f"deadlock: {self.sched.num_running} running, {self.sched.num_waiting} waiting, "
                f"{self.sched.in_flight} steps in flight; " + "; ".join(parts or ["no rank moves"]))
