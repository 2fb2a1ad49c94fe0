"""Replay of the scheduler process: re-drive a fresh :class:`~ppstate.scheduler.Scheduler` with the
recorded inputs and compare every event it emits with the recording.

Inputs (``arrival``, ``abort``, ``stop``, ``result``) are emitted by the scheduler at the start of
the call that observed them, and every derived event (``lifecycle``, ``tokens``) of such a call
follows it. So the recording is walked in order: while replayed events are pending they are
compared one by one; when none is pending, a recorded input is applied to the replay scheduler,
and any other recorded event means the engine called ``schedule()`` there. This reproduces the
exact interleaving of arrivals, results and steps of an asynchronous run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ppstate.batch import StepResult
from ppstate.errors import PPStateError
from ppstate.events import RecordingSink
from ppstate.request import RequestSpec
from ppstate.scheduler import Scheduler
from ppstate.replay.compare import ANY, Divergence, context_before, matches, normalise
from ppstate.trace.models import SCHEDULER_INPUTS
from ppstate.trace.run import TraceRun

SCHEDULER_KINDS = SCHEDULER_INPUTS | {"lifecycle", "schedule", "tokens"}


def spec_of(ev: dict[str, Any], block_size: int) -> RequestSpec:
    """The RequestSpec of a recorded ``arrival``. Prompt ids: the recorded ones; else stand-ins
    built from the recorded ``prefix_hashes`` (see :func:`stand_in_prompt`); else zeros."""
    ids = ev.get("prompt_token_ids")
    if ids is None:
        ids = stand_in_prompt(ev["prompt_len"], ev.get("prefix_hashes") or [], block_size)
    return RequestSpec(ev["req_id"], tuple(ids),
                       ev["max_tokens"], eos_token_ids=frozenset(ev.get("eos_token_ids", ())),
                       stop_token_ids=frozenset(ev.get("stop_token_ids", ())),
                       ignore_eos=ev.get("ignore_eos", False), sampling=ev.get("sampling", {}),
                       fork_of=ev.get("fork_of"), prefix_cache=ev.get("prefix_cache", True))


def stand_in_prompt(prompt_len: int, prefix_hashes: list[int], block_size: int) -> list[int]:
    """``prompt_len`` stand-in token ids whose full blocks are equal exactly where the recorded
    prompts' blocks were (same chained hash), so the replayed prefix cache makes the recorded hits.

    Block i's ``block_size`` tokens are derived from its recorded chain hash ``h_i`` (which covers
    the whole prefix up to it); tokens past the hashed blocks are zeros (partial blocks are never
    cached, so their contents decide nothing).
    """
    out: list[int] = []
    for h in prefix_hashes:
        out.extend(hash((h, j)) & 0x3FFFFFFF for j in range(block_size))
    return out + [0] * (prompt_len - len(out))


def result_of(ev: dict[str, Any]) -> StepResult:
    """The StepResult of a recorded ``result`` event."""
    rows = len(ev["num_sampled"])
    ids = np.asarray(ev["token_ids"], dtype=np.int64).reshape(rows, -1) if rows else \
        np.zeros((0, 1), dtype=np.int64)                 # [num_rows, width]
    return StepResult(ev["of_step"], ids, np.asarray(ev["num_sampled"], dtype=np.int32),
                      np.asarray(ev["num_rejected"], dtype=np.int32))


class EngineReplay:
    """Walks ``run.engine`` against a fresh scheduler.

    Args:
        run: the recorded run.
        until: stop after the recorded events of this step (None: the whole run).
        on_event: called with each recorded scheduler event once it matched (checks, explain).
    """

    def __init__(self, run: TraceRun, until: int | None = None,
                 on_event: Callable[[dict, Scheduler], None] | None = None) -> None:
        self.run, self.until, self.on_event = run, until, on_event
        self.sink = RecordingSink(trace_prompts=run.header.trace_prompts)
        self.sched = Scheduler(run.scheduler_config, sink=self.sink)
        self.recorded = [e for e in run.engine if e.get("kind") in SCHEDULER_KINDS]
        self.divergence: Divergence | None = None
        self.steps = 0
        self.last_step: int | None = None   # the number of the last step re-derived
        self._j = 0

    def replay(self) -> Divergence | None:
        """Compare until the end, ``until`` or the first divergence (returned)."""
        for i, ev in enumerate(self.recorded):
            if self.until is not None and ev.get("step", -1) > self.until:
                break
            if self._j >= len(self.sink.events):
                err = self._drive(ev)
                if err is not None:
                    return self._diverge(i, ev, {"error": err})
            if self._j >= len(self.sink.events):
                return self._diverge(i, ev, None)
            got = normalise(self.sink.events[self._j])
            self._j += 1
            if got.get("kind") == "arrival" and ev.get("prompt_token_ids") is None:
                got["prefix_hashes"] = ANY  # an input: replay hashed stand-in ids (spec_of)
            if not matches(got, ev):
                return self._diverge(i, ev, got)
            if ev["kind"] == "schedule":
                self.steps += 1
                self.last_step = ev["step"]
            if self.on_event is not None:
                self.on_event(ev, self.sched)
        return None

    def _drive(self, ev: dict[str, Any]) -> str | None:
        """Apply a recorded input, or call ``schedule()``; an error message if it raised."""
        kind = ev["kind"]
        try:
            if kind == "arrival":
                self.sched.add_request(spec_of(ev, self.sched.config.block_size))
            elif kind == "abort":
                self.sched.abort(ev["req_id"])
            elif kind == "stop":
                self.sched.stop(ev["req_id"])
            elif kind == "result":
                self.sched.on_step_result(result_of(ev))
            else:
                self.sched.schedule()
        except (PPStateError, ValueError, KeyError, IndexError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _diverge(self, i: int, ev: dict, got: dict | None) -> Divergence:
        kind = got.get("kind", ev["kind"]) if isinstance(got, dict) else ev["kind"]
        step = ev.get("step", -1)
        self.divergence = Divergence(step, None, kind, ev, got,
                                     context_before(self.recorded, i))
        return self.divergence
