"""The invariant checker shared by the simulator, the trace replayer and the model checker
(docs/design.md §6 and specs/invariants.md: invariants 1, 2, 3, 5, 6, 7; 4 for the
``num_computed_tokens`` mirror).

The checker receives ground truth from the backend's ranks and the client side and records one
:class:`Violation` per broken rule; it never raises, so a run reports every violation it meets.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.lanes import lane_row_cap
from ppstate.request import TokenUpdate
from ppstate.oracle.model import ExpectedOutput, SimRequest, expected_output
from ppstate.scheduler import Scheduler

MAX_REPORTED = 50  # violations kept per run (the count keeps going)

#: titles of the invariants, numbered as in ``specs/invariants.md`` (DESIGN section 4 + KV)
INVARIANT_NAMES = {
    1: "collective matching", 2: "no stale application", 3: "exactly-once, in-order delivery",
    4: "mirror agreement", 5: "cadence", 6: "liveness", 7: "budgets", 8: "KV completeness",
    9: "KV blocks",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: its number (specs/invariants.md), where, and what happened.

    ``slot`` and ``req_id`` are set where the check knows them (None otherwise, and then left
    out of :meth:`as_dict`, so reports of checks that do not set them read as before)."""
    invariant: int
    step: int
    rank: int | None
    message: str
    slot: int | None = None
    req_id: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        for key in ("slot", "req_id"):
            if d[key] is None:
                del d[key]
        return d


def describe(v: dict) -> str:
    """One line of a violation dict: ``invariant N (title) violated at step S rank R [slot X]
    [request ID]: message`` (rank, slot and request only where known)."""
    n = v["invariant"]
    where = f"step {v['step']}" + (f" rank {v['rank']}" if v.get("rank") is not None else "")
    where += f" slot {v['slot']}" if v.get("slot") is not None else ""
    where += f" request {v['req_id']}" if v.get("req_id") is not None else ""
    return f"invariant {n} ({INVARIANT_NAMES.get(n, '?')}) violated at {where}: {v['message']}"


class InvariantOracle:
    """Collects violations of one simulation run.

    Args:
        requests: the workload (prompt lengths, expected outputs).
        sched: the scheduler under test (budgets, slot table).
    """

    def __init__(self, requests: tuple[SimRequest, ...], sched: Scheduler) -> None:
        self.sched, self.cfg = sched, sched.config
        # Invariant 5's cadence from the design, not from the scheduler's own property.
        self.cadence = self.cfg.pp_size if self.cfg.mode == "overlapped" else 1
        self.prompt_len = {r.req_id: len(r.prompt) for r in requests}
        self.expected = {r.req_id: expected_output(r, self.cfg.max_model_len) for r in requests}
        self._truth = {r.req_id: np.array(r.prompt + tuple(self.expected[r.req_id].tokens),
                                          dtype=np.int64) for r in requests}
        # (step, req_id) -> (admission step, prefill length, outputs kept) of the row's admission
        self.admission: dict[str, tuple[int, int, int]] = {}
        self.row_admission: dict[tuple[int, str], tuple[int, int, int]] = {}
        self.violations: list[Violation] = []
        self.num_violations = 0
        self.sampling_steps: dict[str, list[int]] = defaultdict(list)
        self.sampled_by_last: dict[str, dict[int, int]] = defaultdict(dict)  # output index -> id
        # speculative decoding: req_id -> {sampling step -> tokens the last rank emitted}
        self.num_emitted: dict[str, dict[int, int]] | None = \
            defaultdict(dict) if self.cfg.num_spec_tokens else None
        self.received: dict[str, list[int]] = defaultdict(list)
        self.closed: dict[str, str] = {}     # req_id -> finish reason seen by the client
        self._posts: dict[int, dict[int, bool]] = defaultdict(dict)
        self.post_log: dict[int, tuple[bool, ...]] = {}  # step -> posted, per rank

    def violation(self, invariant: int, step: int, rank: int | None, message: str,
                  slot: int | None = None, req_id: str | None = None) -> None:
        """Record a violation (the first MAX_REPORTED are kept); ``slot`` / ``req_id`` where
        the check knows them."""
        self.num_violations += 1
        if len(self.violations) < MAX_REPORTED:
            self.violations.append(Violation(invariant, step, rank, message, slot, req_id))

    def true_sequence(self, req_id: str) -> np.ndarray:
        """``[prompt + expected outputs]`` token ids of ``req_id`` (what its KV cache holds)."""
        return self._truth[req_id]

    def _head_fits(self) -> bool:
        """The oldest waiting request's first token would fit the free KV blocks now."""
        head, kv = self.sched.peek_waiting(), self.sched.kv
        return head is not None and kv.admissible_tokens(kv.prefix_hit(head), 1) >= 1

    def _row_info(self, step: int, rid: str) -> tuple[int, int, int]:
        return self.row_admission.get((step, rid), (0, self.prompt_len[rid], 0))

    # ---------------------------------------------------------- scheduler side (5, 7, 9)
    def on_issue(self, out: SchedulerOutput) -> None:
        """Cadence (5), budgets / balance (7) and the KV block pool (9) of a freshly issued step.
        Rows are judged against their own admission (a preempted request is re-admitted with its
        kept outputs as part of the prefill)."""
        cfg, s = self.cfg, out.step
        for n in out.new_requests:
            self.admission[n.req_id] = (s, len(n.prompt_token_ids), n.num_output_tokens)
        for rid in out.req_ids:
            self.row_admission[(s, rid)] = self.admission[rid]
        try:
            self.sched.kv.pool.check_invariants()
        except Exception as exc:  # noqa: BLE001 - any BlockError is a violation
            self.violation(9, s, None, f"block pool: {exc}")
        if out.total_tokens > cfg.max_num_batched_tokens:
            self.violation(7, s, None, f"{out.total_tokens} tokens > max_num_batched_tokens")
        if self.sched.slots.num_allocated > cfg.max_num_seqs:
            self.violation(7, s, None, f"{self.sched.slots.num_allocated} live > max_num_seqs")
        new = {n.req_id for n in out.new_requests}
        capped = sum(1 for i, rid in enumerate(out.req_ids)   # continuing chunks are exempt
                     if rid in new or out.start_positions[i] >= self._row_info(s, rid)[1])
        cap = lane_row_cap(cfg, self.sched.lanes)  # max_rows_per_step with all lanes open
        if capped > cap:
            self.violation(7, s, None, f"{capped} rows > balanced cap {cap} "
                           f"({self.sched.lanes} lanes)")
        preempted = any(f.reason == "preempted" for f in out.freed)  # no admission then
        if out.num_rows == 0 and self.sched.num_waiting and self.sched.slots.num_free and \
                not preempted and self._head_fits():
            self.violation(7, s, None, "empty batch while requests wait and slots and KV "
                           "blocks are free")
        for i, rid in enumerate(out.req_ids):
            steps = self.sampling_steps[rid]
            admitted, prefill, _ = self._row_info(s, rid)
            is_decode = int(out.start_positions[i]) >= prefill
            if is_decode and steps and steps[-1] >= admitted and s - steps[-1] < self.cadence:
                self.violation(5, s, None, f"request {rid} decodes at step {s}, "
                               f"{s - steps[-1]} steps after step {steps[-1]} (< {self.cadence})",
                               slot=int(out.slots[i]), req_id=rid)
            if out.is_final_chunk[i]:
                steps.append(s)

    # ---------------------------------------------------------- rank side (1, 2, 3)
    def record_post(self, out: SchedulerOutput, rank: int, posted: bool,
                    mask: np.ndarray | None = None) -> None:
        """Rank ``rank`` did (not) post its side of step ``out.step``'s broadcast (invariant 1).

        Checked against :meth:`rows_needing_sample`, a statement of the rule that does not use
        the runtime's decision function, and across ranks once all of them reported.

        Args:
            out: the step.
            rank: the reporting rank.
            posted: it posts the broadcast (last rank) / the receive (other ranks).
            mask: ``[num_rows]`` bool need-sampled mask a non-last rank enqueued, or None.
        """
        step, need = out.step, self.rows_needing_sample(out)
        if posted != bool(need.any()):
            self.violation(1, step, rank, f"rank {rank} {'posted' if posted else 'skipped'} the "
                           f"broadcast; rows needing a sample: {np.nonzero(need)[0].tolist()}")
        if mask is not None and not np.array_equal(np.asarray(mask, dtype=bool), need):
            self.violation(1, step, rank, f"need-sampled mask {np.asarray(mask).tolist()} of rank "
                           f"{rank}, expected {need.tolist()}")
        posts = self._posts[step]
        posts[rank] = posted
        if len(posts) == self.cfg.pp_size:
            self.post_log[step] = tuple(posts[r] for r in range(self.cfg.pp_size))
            if len(set(posts.values())) != 1:
                self.violation(1, step, None, f"broadcast posted by ranks "
                               f"{sorted(r for r, p in posts.items() if p)} only")
            del self._posts[step]

    def rows_needing_sample(self, out: SchedulerOutput) -> np.ndarray:
        """``[num_rows]`` bool: the row's tokens reach the end of what its admission prefills
        (final chunk or decode), from the row's chunk position and the prefill length of the
        row's admission alone (the prompt; prompt + kept outputs after a preemption)."""
        ends = out.start_positions.astype(np.int64) + out.num_scheduled_tokens.astype(np.int64)
        plen = np.array([self._row_info(out.step, r)[1] for r in out.req_ids], dtype=np.int64)
        return ends >= plen

    def check_apply(self, rank: int, step: int, row_req: str, slot: int, owner: str | None) -> None:
        """A deferred row of ``step`` for ``row_req`` is being applied to ``slot`` (invariant 2)."""
        if owner != row_req:
            self.violation(2, step, rank, f"deferred token of {row_req} (step {step}) applied to "
                           f"slot {slot} now owned by {owner}", slot=slot, req_id=row_req)

    def check_owner(self, rank: int, step: int, slot: int, want: str | None,
                    have: str | None) -> None:
        """Slot ownership before free (``want`` = freed request) or new (``want`` = None)."""
        if want != have:
            self.violation(2, step, rank, f"slot {slot} owned by {have}, expected {want}",
                           slot=slot)

    def check_inputs(self, rank: int, out: SchedulerOutput, owner: list[str | None],
                     history: list[list[int]]) -> None:
        """Every decode row's input token is the last rank's previous sample for that request."""
        for i, rid in enumerate(out.req_ids):
            slot = int(out.slots[i])
            if owner[slot] != rid:
                self.violation(2, out.step, rank, f"row {rid} runs on slot {slot} owned by "
                               f"{owner[slot]}", slot=slot, req_id=rid)
                continue
            admitted, prefill, kept = self._row_info(out.step, rid)
            if int(out.start_positions[i]) < prefill:
                continue
            n_prev = self._outputs_before(rid, out.step, admitted, kept)
            hist = history[slot]
            truth = self.sampled_by_last[rid]
            if len(hist) != n_prev or not hist or hist[-1] != truth.get(n_prev - 1):
                self.violation(3, out.step, rank, f"decode input of {rid}: device has "
                               f"{len(hist)} sampled ids ending {hist[-1:]}, last rank sampled "
                               f"{n_prev} ending {truth.get(n_prev - 1)}", slot=slot, req_id=rid)

    def _outputs_before(self, rid: str, step: int, admitted: int, kept: int) -> int:
        """Outputs ``rid`` holds before step ``step`` in its admission at ``admitted`` (with
        ``kept`` outputs kept): one per sampling step, or what each emitted with speculation."""
        steps = self.sampling_steps[rid]
        lo, hi = bisect_left(steps, admitted), bisect_left(steps, step)
        if self.num_emitted is None:
            return kept + hi - lo
        emitted = self.num_emitted[rid]
        return kept + sum(emitted.get(s, 0) for s in steps[lo:hi])

    def record_sampled(self, out: SchedulerOutput, tokens: np.ndarray,
                       num_sampled: np.ndarray | None = None) -> None:
        """Ground truth: ids the last rank sampled for the sampling rows of ``out``.

        Args:
            tokens: ``[num_rows]`` one id per row, or with ``num_sampled`` (speculative decoding)
                ``[num_rows, K + 1]``, of which row ``i`` emitted the first ``num_sampled[i]``.
        """
        for i in np.nonzero(out.is_final_chunk)[0].tolist():
            rid = out.req_ids[i]
            admitted, _, kept = self._row_info(out.step, rid)
            index = self._outputs_before(rid, out.step, admitted, kept)
            if num_sampled is None:
                self.sampled_by_last[rid][index] = int(tokens[i])
                continue
            self.num_emitted[rid][out.step] = n = int(num_sampled[i])
            for j in range(n):
                self.sampled_by_last[rid][index + j] = int(tokens[i, j])

    # ---------------------------------------------------------- client side (3)
    def on_updates(self, step: int, updates: list[TokenUpdate]) -> None:
        """Exactly-once, in-order delivery, nothing after finish / abort."""
        for u in updates:
            rid, got = u.req_id, self.received[u.req_id]
            if rid in self.closed:
                self.violation(3, step, None, f"{rid} got {u.token_ids} after {self.closed[rid]}",
                               req_id=rid)
                continue
            got.extend(u.token_ids)
            exp: ExpectedOutput = self.expected[rid]
            if got != exp.tokens[:len(got)]:
                self.violation(3, step, None, f"{rid} received tokens differ from the model's "
                               f"at index {_first_diff(got, exp.tokens)}", req_id=rid)
            if u.finish_reason is not None:
                self.closed[rid] = u.finish_reason
                if u.finish_reason != exp.reason or len(got) != len(exp.tokens):
                    self.violation(3, step, None, f"{rid} finished {u.finish_reason} after "
                                   f"{len(got)} tokens, expected {exp.reason} after "
                                   f"{len(exp.tokens)}", req_id=rid)

    def on_abort(self, req_id: str) -> None:
        self.closed[req_id] = "abort"

    # ---------------------------------------------------------- end of run (6)
    def finish(self, step: int, reason: str | None) -> None:
        """Liveness: the run ended with every request final and nothing in flight."""
        if reason is not None:
            self.violation(6, step, None, reason)
        open_reqs = [r for r in self.expected if r not in self.closed]
        if open_reqs:
            self.violation(6, step, None, f"{len(open_reqs)} requests never finished, e.g. "
                           f"{open_reqs[:3]}")


def _first_diff(got: list[int], want: list[int]) -> int:
    """First index where ``got`` differs from ``want`` (or runs past its end)."""
    for k, tok in enumerate(got):
        if k >= len(want) or tok != want[k]:
            return k
    return len(got)
