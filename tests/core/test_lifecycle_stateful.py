"""Stateful property test: the request Lifecycle and the SlotTable driven together by random
admissions, prefill chunks, prefill completions, finishes and aborts, with the slot invariants
checked after every rule."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ppstate.errors import IllegalTransition
from ppstate.lifecycle import Lifecycle
from ppstate.slots import SlotTable

NUM_SLOTS = 3
LIVE_WITH_SLOT = ("prefilling", "decoding")


class Req:
    """Request model: progress in tokens, guards read the slot table and the progress."""

    def __init__(self, req_id: str, prompt_len: int, slots: SlotTable) -> None:
        self.req_id, self.prompt_len, self.slots = req_id, prompt_len, slots
        self.computed = 0  # prompt tokens scheduled so far

    def has_slot(self) -> bool:
        return self.slots.lookup(self.req_id) is not None

    def prefill_fully_scheduled(self) -> bool:
        return self.computed >= self.prompt_len


class LifecycleWithSlots(RuleBasedStateMachine):
    """Model: every request is in ``self.reqs``; ``self.frees[i]`` counts frees of slot i."""

    def __init__(self) -> None:
        super().__init__()
        self.lc = Lifecycle()
        self.slots = SlotTable(NUM_SLOTS)
        self.reqs: dict[str, Req] = {}
        self.frees = np.zeros(NUM_SLOTS, dtype=np.int64)
        self.prev_generation = self.slots.generation.copy()

    def _ids(self, *states: str) -> list[str]:
        return sorted(r for r, req in self.reqs.items() if req.state in states)

    def _pick(self, data, *states: str) -> Req:
        return self.reqs[data.draw(st.sampled_from(self._ids(*states)), label="req_id")]

    def _release(self, req: Req) -> None:
        idx = self.slots.lookup(req.req_id)
        if idx is None:
            return
        before = int(self.slots.generation[idx])
        assert self.slots.free(req.req_id) == idx
        assert int(self.slots.generation[idx]) == before + 1
        self.frees[idx] += 1

    def _finish(self, req: Req, trigger: str, final: str) -> None:
        assert self.lc.fire(req, trigger) == final
        self._release(req)
        self.lc.remove(req)

    @rule(prompt_len=st.integers(1, 8))
    def add_request(self, prompt_len: int) -> None:
        req = Req(f"r{len(self.reqs)}", prompt_len, self.slots)
        self.lc.add(req)
        self.reqs[req.req_id] = req
        assert req.state == "waiting"

    @precondition(lambda self: self._ids("waiting"))
    @rule(data=st.data())
    def admit(self, data) -> None:
        req = self._pick(data, "waiting")
        if self.slots.num_free == 0:
            with pytest.raises(IllegalTransition, match="guard returned False"):
                self.lc.fire(req, "admit")
            assert req.state == "waiting"
            return
        idx = self.slots.allocate(req.req_id)
        assert self.lc.fire(req, "admit") == "prefilling"
        assert self.slots.owner[idx] == req.req_id

    @precondition(lambda self: any(self.reqs[r].prompt_len - self.reqs[r].computed > 1
                                   for r in self._ids("prefilling")))
    @rule(data=st.data())
    def chunk(self, data) -> None:
        ids = [r for r in self._ids("prefilling")
               if self.reqs[r].prompt_len - self.reqs[r].computed > 1]
        req = self.reqs[data.draw(st.sampled_from(ids), label="req_id")]
        req.computed += data.draw(st.integers(1, req.prompt_len - req.computed - 1), label="chunk")
        assert req.state == "prefilling"

    @precondition(lambda self: self._ids("prefilling"))
    @rule(data=st.data())
    def complete_prefill(self, data) -> None:
        req = self._pick(data, "prefilling")
        if not req.prefill_fully_scheduled():
            with pytest.raises(IllegalTransition, match="guard returned False"):
                self.lc.fire(req, "complete_prefill")
            req.computed = req.prompt_len  # schedule the final chunk
        assert self.lc.fire(req, "complete_prefill") == "decoding"

    @precondition(lambda self: self._ids("decoding"))
    @rule(data=st.data(), how=st.sampled_from([("stop", "finished_stopped"),
                                               ("hit_length", "finished_length")]))
    def finish(self, data, how: tuple[str, str]) -> None:
        self._finish(self._pick(data, "decoding"), *how)

    @precondition(lambda self: self._ids("waiting", "prefilling"))
    @rule(data=st.data(), trigger=st.sampled_from(["stop", "hit_length"]))
    def finish_too_early(self, data, trigger: str) -> None:
        req = self._pick(data, "waiting", "prefilling")
        state = req.state
        with pytest.raises(IllegalTransition, match="no such edge"):
            self.lc.fire(req, trigger)
        assert req.state == state

    @precondition(lambda self: self._ids("waiting", "prefilling", "decoding"))
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._finish(self._pick(data, "waiting", "prefilling", "decoding"), "abort",
                     "finished_aborted")

    @invariant()
    def one_live_request_per_slot_and_owner_matches(self) -> None:
        held = {r: self.slots.lookup(r) for r in self._ids(*LIVE_WITH_SLOT)}
        assert None not in held.values()
        assert max(Counter(held.values()).values(), default=0) <= 1
        for r, idx in held.items():
            assert self.slots.owner[idx] == r
        assert sum(o is not None for o in self.slots.owner) == len(held)

    @invariant()
    def generation_counts_frees_and_never_decreases(self) -> None:
        gen = self.slots.generation
        assert gen.tolist() == self.frees.tolist()
        assert bool(np.all(gen >= self.prev_generation))
        self.prev_generation = gen.copy()

    @invariant()
    def finished_and_waiting_requests_hold_no_slot(self) -> None:
        for r in self._ids("waiting", *self.lc.final_states):
            assert self.slots.lookup(r) is None
        for r in self._ids(*self.lc.final_states):
            assert self.reqs[r] not in self.lc.machine.models

    @invariant()
    def allocated_equals_live_prefilling_or_decoding(self) -> None:
        assert self.slots.num_allocated == len(self._ids(*LIVE_WITH_SLOT))
        assert self.slots.num_free == NUM_SLOTS - self.slots.num_allocated


LifecycleWithSlots.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestLifecycleWithSlots = LifecycleWithSlots.TestCase
