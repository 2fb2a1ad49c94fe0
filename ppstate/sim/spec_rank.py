"""One simulated rank's speculative decoding (issue #33): drafts, verify rows and their checks.

A :class:`~ppstate.sim.rank.SimRank` built with ``spec = (K, acceptance)``, K > 0, delegates here;
with K = 0 none of this runs and the rank behaves as before. The rank does what the runtime's
ranks do (``runtime/sampling/speculative_verify.py``):

* before the forward, each row's start position comes from the rank's own ``num_computed``
  (which already holds every rejection it consumed), a row is a decode row when its slot's
  prefill is done (mirror), and a decode row carries ``k = num_scheduled_tokens - 1`` drafts;
  rank 0 and the last rank compute the drafts from their own histories
  (:func:`ppstate.sim.spec.propose`); rank 0 feeds them as input ids (``[rows, K + 1]``, handed
  on as the "hidden states");
* the KV cache is written at all ``1 + k`` positions (drafts included) and read back up to the
  row's first position only (:meth:`ppstate.sim.kv.SimKV.forward`): rejected drafts' cells are
  stale until a later row overwrites them, exactly as on the device;
* the last rank verifies (:func:`ppstate.sim.spec.verify`) into a ``[rows, K + 3]`` payload; every
  rank rolls ``num_rejected`` back on apply (the last rank at once, the others on the deferred
  consume: the rejected-draft correction).

Checks (the :class:`~ppstate.oracle.invariants.InvariantOracle` records them): rank 0's drafts
equal the last rank's (3); the payload is ``K + 1`` wide with ``num_sampled + num_rejected =
1 + k`` on sampled rows (1); after a row is applied, the rank's history equals the last rank's
tokens (3), its ``num_computed`` covers exactly the accepted tokens, ``prompt + outputs - 1``
(8), and the slot's KV blocks hold those positions with at most ``2 K`` positions of surplus (the
blocks of rejected drafts stay with the request, as the scheduler keeps them; 9). No rejected
token is ever emitted: the client check compares every received token with the model's (3).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.payload import SampledPayload
from ppstate.sim.spec import propose, verify


class SimSpec:
    """Speculative state of one rank.

    Args:
        rank: the :class:`~ppstate.sim.rank.SimRank` (its slot tokens, counters, mirror, KV and
            checker are used; not imported here: the rank imports this module).
        k: ``K`` (>= 1), drafts per decode row at most.
        acceptance: the proposer's per-draft acceptance probability.
    """

    def __init__(self, rank: Any, k: int, acceptance: float) -> None:
        self.r, self.k, self.acceptance = rank, k, acceptance
        n = rank.num_computed.size
        self.base_len = np.zeros(n, dtype=np.int64)  # [max_num_reqs] prompt without kept outputs
        self.starts = np.zeros(0, dtype=np.int64)      # [num_rows] of the current step
        self.num_drafts = np.zeros(0, dtype=np.int64)  # [num_rows]
        self.drafts = np.zeros((0, k), dtype=np.int64)  # [num_rows, K] own proposals

    def admit(self, out: SchedulerOutput) -> None:
        """Remember each admitted request's prompt length without its kept outputs."""
        for n in out.new_requests:
            self.base_len[n.slot] = len(n.prompt_token_ids) - n.num_output_tokens

    def prepare(self, out: SchedulerOutput) -> np.ndarray | None:
        """Plan the step's rows (starts, drafts); rank 0: ``[rows, K + 1]`` input ids (-1 pad)."""
        r, m = self.r, self.r.mirror
        slots = out.slots.astype(np.int64)
        self.starts = r.num_computed[slots].copy()
        decode = m.num_computed_prefill_tokens_np[slots] >= m.prefill_len_np[slots]
        self.num_drafts = np.where(decode, out.num_scheduled_tokens.astype(np.int64) - 1, 0)
        over = np.nonzero(self.num_drafts > self.k)[0]
        if over.size:
            r.checker.violation(7, out.step, r.rank, f"{out.req_ids[int(over[0])]} carries "
                                f"{int(self.num_drafts[over[0]])} drafts > K = {self.k}",
                                slot=int(slots[over[0]]), req_id=out.req_ids[int(over[0])])
            self.num_drafts = np.minimum(self.num_drafts, self.k)
        if r.rank == 0 or r.is_last:
            self.drafts = self._propose(out)
        if r.rank != 0:
            return None
        inputs = np.full((out.num_rows, self.k + 1), -1, dtype=np.int64)
        inputs[:, 0] = r.slot_tokens.input_tokens(out)
        cols = np.arange(self.k)
        inputs[:, 1:] = np.where(cols < self.num_drafts[:, None], self.drafts, -1)
        return inputs

    def _propose(self, out: SchedulerOutput) -> np.ndarray:
        """``[rows, K]`` this rank's drafts, from its own history (zeros past a row's ``k``)."""
        st, drafts = self.r.slot_tokens, np.zeros((out.num_rows, self.k), dtype=np.int64)
        for i in np.nonzero(self.num_drafts)[0].tolist():
            slot, nd = int(out.slots[i]), int(self.num_drafts[i])
            hist = st.history[slot]
            prev = hist[-1] if hist else int(st.last_prompt[slot])
            drafts[i, :nd] = propose(int(st.sample_seed[slot]), len(hist), prev, nd,
                                     self.acceptance, int(self.r.eos_at[slot]))
        return drafts

    def sample(self, out: SchedulerOutput, inputs: np.ndarray | None) -> SampledPayload:
        """Last rank: verify every sampled row against its own drafts; the ``[rows, K + 3]``
        payload. ``inputs`` is rank 0's ``[rows, K + 1]`` (None for an empty step)."""
        r, st = self.r, self.r.slot_tokens
        if inputs is None or out.num_rows == 0:
            return SampledPayload.zeros(out.num_rows, self.k + 1)
        rows = np.nonzero(out.is_final_chunk)[0]
        slots = out.slots.astype(np.int64)
        for i in rows.tolist():
            nd = int(self.num_drafts[i])
            if nd and not np.array_equal(inputs[i, 1:nd + 1], self.drafts[i, :nd]):
                r.checker.violation(3, out.step, r.rank, f"drafts of {out.req_ids[i]}: rank 0 "
                                    f"fed {inputs[i, 1:nd + 1].tolist()}, the last rank "
                                    f"proposes {self.drafts[i, :nd].tolist()}",
                                    slot=int(slots[i]), req_id=out.req_ids[i])
        index = np.array([len(st.history[s]) for s in slots.tolist()], dtype=np.int64)
        payload = verify(inputs, self.num_drafts, self.drafts, st.sample_seed[slots], index,
                         r.eos_at[slots], rows, self.k + 1)
        r.checker.record_sampled(out, payload.token_ids, payload.num_sampled)
        self.check_width(out.step, payload, out)
        return payload

    def check_width(self, step: int, payload: SampledPayload,
                    out: SchedulerOutput | None = None) -> None:
        """The payload is ``K + 1`` ids wide; on the last rank also ``num_sampled +
        num_rejected = 1 + k`` on every sampled row (invariant 1: every rank's buffer matches)."""
        r = self.r
        if payload.width != self.k + 1:
            r.checker.violation(1, step, r.rank, f"payload width {payload.width}, K + 1 = "
                                f"{self.k + 1}")
        if out is not None:
            ns = np.asarray(payload.num_sampled)
            total = ns + np.asarray(payload.num_rejected)
            bad = np.nonzero((ns > 0) & (total != self.num_drafts + 1))[0]
            if bad.size:
                r.checker.violation(1, step, r.rank, f"row {int(bad[0])}: num_sampled + "
                                    f"num_rejected = {int(total[bad[0]])}, 1 + k = "
                                    f"{int(self.num_drafts[bad[0]]) + 1}")

    def applied(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        """After ``apply_sampled`` of step ``step``: history (3), extent (8), blocks (9)."""
        r, st, chk = self.r, self.r.slot_tokens, self.r.checker
        ns = np.asarray(payload.num_sampled)
        bs, slack = r.kv.bs, 2 * self.k
        for i in np.nonzero((idx_mapping >= 0) & (ns > 0))[0].tolist():
            slot, n = int(idx_mapping[i]), int(ns[i])
            rid, hist = st.owner[slot], st.history[slot]
            if not r.is_last:
                truth = chk.sampled_by_last[rid]
                for j in range(len(hist) - n, len(hist)):
                    if hist[j] != truth.get(j):
                        chk.violation(3, step, r.rank, f"{rid}: output {j} is {hist[j]} on rank "
                                      f"{r.rank}, the last rank sampled {truth.get(j)}",
                                      slot=slot, req_id=rid)
                        break
            computed, want = int(r.num_computed[slot]), int(self.base_len[slot]) + len(hist) - 1
            if computed != want:
                chk.violation(8, step, r.rank, f"{rid}: {computed} KV positions computed after "
                              f"step {step}, accepted tokens cover {want}", slot=slot, req_id=rid)
            held = int(r.kv.num_blocks[slot])
            if not -(-want // bs) <= held <= -(-(want + slack) // bs):
                chk.violation(9, step, r.rank, f"{rid}: holds {held} KV blocks for {want} "
                              f"accepted positions (block size {bs}, surplus at most {slack})",
                              slot=slot, req_id=rid)
