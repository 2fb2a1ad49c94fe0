"""A simulated pipeline driven by a test: add requests, abort, step, read events.

:class:`SimPipeline` wraps :class:`ppstate.sim.Simulator` (the real scheduler, simulated ranks
with PPHandlers and CPU mirrors, the invariant checker) but takes its requests from the test
instead of a drawn workload. Time is the simulator's logical ticks; nothing depends on the wall
clock, so one config and seed reproduce a run exactly. The scheduler's events are always
recorded (:class:`~ppstate.events.RecordingSink`) and can be written as a replayable trace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ppstate.events import RecordingSink
from ppstate.scheduler import RequestSpec
from ppstate.sim.simulator import Simulator
from ppstate.oracle.model import EOS_TOKEN, FIRST_TOKEN, VOCAB, SimRequest, expected_output
from ppstate.sim.workload import SimConfig
from ppstate.trace.run import write_run


class SimPipeline:
    """One simulated run under the test's control.

    Args:
        config: a :class:`SimConfig`; its ``num_requests`` / ``workload`` are ignored (requests
            come from :meth:`add_request`).
        seed: overrides ``config.seed``; it draws prompt ids and per-request sampling seeds.

    Attributes:
        sim: the underlying :class:`~ppstate.sim.Simulator` (``sim.sched`` is the scheduler).
        sink: every scheduler event so far (``sink.events``, flat dicts as in a trace).
    """

    def __init__(self, config: SimConfig | None = None, seed: int | None = None) -> None:
        cfg = config or SimConfig()
        cfg = dataclasses.replace(cfg, workload=(), num_requests=0,
                                  seed=cfg.seed if seed is None else seed)
        self.config = cfg
        self.sink = RecordingSink()
        self.sim = Simulator(cfg, sink=self.sink)
        self.sim._pending_results = []
        self._rng = np.random.default_rng(cfg.seed)
        self._finished = False

    # ---- inputs --------------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt: int | tuple[int, ...] = 8, max_tokens: int = 8,
                    eos_at: int = -1, ignore_eos: bool = False) -> SimRequest:
        """Submit a request now (it reaches the scheduler at the current tick).

        Args:
            prompt: prompt length in tokens (ids drawn from the seed) or explicit ids.
            max_tokens: new tokens allowed.
            eos_at: output index at which the simulated model emits EOS (-1: never).
        """
        ids = tuple(int(x) for x in self._rng.integers(FIRST_TOKEN, VOCAB, size=prompt)) \
            if isinstance(prompt, int) else tuple(prompt)
        req = SimRequest(req_id, self.sim.now, ids, max_tokens, int(self._rng.integers(1, 2**31)),
                         eos_at, ignore_eos)
        sim, chk = self.sim, self.sim.checker
        sim.requests = (*sim.requests, req)
        exp = expected_output(req, self.config.scheduler.max_model_len)
        chk.prompt_len[req_id], chk.expected[req_id] = len(ids), exp
        chk._truth[req_id] = np.array(ids + tuple(exp.tokens), dtype=np.int64)
        sim.max_steps = self.config.max_steps or sim._step_bound()
        sim.sched.add_request(RequestSpec(
            req_id, ids, max_tokens, eos_token_ids=frozenset({EOS_TOKEN}), ignore_eos=ignore_eos,
            sampling={"seed": req.sample_seed, "eos_at": eos_at}))
        return req

    def abort(self, req_id: str) -> bool:
        """Abort ``req_id`` now; False when it already finished (nothing happens then)."""
        if req_id in self.sim.checker.closed or not self.sim.sched.abort(req_id):
            return False
        self.sim.num_aborted += 1
        self.sim.checker.on_abort(req_id)
        return True

    # ---- time ----------------------------------------------------------------------------------
    def tick(self) -> bool:
        """One round of the simulator's loop (complete stages, deliver results, issue steps,
        start ranks) and advance to the next event time. False when nothing is left to do."""
        sim = self.sim
        sim._complete()
        sim._deliver_results()
        sim._issue()
        sim._start_ranks()
        nxt = sim._next_time()
        if nxt is None:
            return False
        sim.now = max(nxt, sim.now)
        return True

    def step(self, n: int = 1) -> int:
        """Run until at least ``n`` more steps were issued by the scheduler (one round may issue
        several: up to ``pp_size + 1`` in flight), or nothing is left to do; returns the next
        step number."""
        target = self.sim.sched.next_step + n
        while self.sim.sched.next_step < target and self.tick():
            if self.sim.sched.next_step > self.sim.max_steps:
                break
        return self.sim.sched.next_step

    def run_until_done(self) -> int:
        """Run until every request finished and nothing is in flight, then check liveness
        (invariant 6). Returns the number of steps issued."""
        while self.sim.sched.next_step <= self.sim.max_steps and self.tick():
            pass
        for _ in range(2):  # results whose delivery time is the last event time
            self.tick()
        stuck = None
        sched = self.sim.sched
        if sched.next_step > self.sim.max_steps:
            stuck = f"no progress bound: {sched.next_step} steps > {self.sim.max_steps}"
        elif sched.has_unfinished() or sched.in_flight:
            stuck = (f"deadlock at tick {self.sim.now}: {sched.num_running} running, "
                     f"{sched.num_waiting} waiting, {sched.in_flight} steps in flight")
        if not self._finished:
            self._finished = True
            self.sim.checker.finish(sched.next_step, stuck)
        return sched.next_step

    # ---- reading -------------------------------------------------------------------------------
    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Scheduler events so far (``{"kind", "step", "rank", ...}``), optionally of one kind
        (``arrival``, ``abort``, ``schedule``, ``result``, ``tokens``, ``lifecycle``)."""
        return [e for e in self.sink.events if kind is None or e["kind"] == kind]

    def tokens(self, req_id: str) -> list[int]:
        """Token ids delivered to the client of ``req_id`` so far."""
        return list(self.sim.checker.received.get(req_id, []))

    def expected_tokens(self, req_id: str) -> list[int]:
        """The simulated model's full output for ``req_id`` (if not aborted)."""
        return list(self.sim.checker.expected[req_id].tokens)

    def finish_reason(self, req_id: str) -> str | None:
        """``stop`` / ``length`` / ``abort`` once ``req_id`` finished, else None."""
        return self.sim.checker.closed.get(req_id)

    def violations(self) -> list[dict]:
        """Invariant violations found so far (``{invariant, step, rank, message}``, plus
        ``slot`` / ``req_id`` where known)."""
        return [v.as_dict() for v in self.sim.checker.violations]

    def write_trace(self, trace_dir: str | Path) -> Path:
        """Write the run so far as a new run directory under ``trace_dir`` (source ``sim``);
        ``python -m ppstate.replay`` / :func:`ppstate.testing.replay` read it. The header
        records the violations found so far (replay reports them as ``recorded_violations``)."""
        extra = {"recorded_violations": self.violations(),
                 "num_recorded_violations": self.sim.checker.num_violations}
        return write_run(trace_dir, "sim", self.sim.sched.config, dataclasses.asdict(self.config),
                         list(self.sink.events), seed=self.config.seed, extra=extra)
