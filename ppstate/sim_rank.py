"""One simulated PP rank: its "device" per-slot state, CPU mirrors and (non-last) PPHandler.

Each rank applies a step as the runtime worker does: deferred consume (non-last ranks), then the
step's ``freed`` and ``new_requests`` and block-table deltas, then the forward (KV writes and reads
through the block table, :mod:`ppstate.sim_kv`; immediate ``num_computed_tokens`` update),
then the last rank samples and decides to broadcast while earlier ranks post the deferred receive.
Ground truth for the invariant checks is reported to :class:`ppstate.sim_checks.InvariantChecker`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.mirror import CpuMirror
from ppstate.pp_handler import PPHandler, need_sampled_mask, should_broadcast
from ppstate.sim_kv import SimKV
from ppstate.sim_workload import model_token

if TYPE_CHECKING:
    from ppstate.sim_checks import InvariantChecker


@dataclass
class Wire:
    """What travels between simulated ranks, keyed by step.

    Attributes:
        outputs: step -> SchedulerOutput (every rank gets the same one).
        hidden: step -> ``[num_rows]`` rank 0's input token per row (stands for the hidden states
            handed rank to rank by p2p).
        broadcast: step -> ``[num_rows]`` ids the last rank sampled (the side-group broadcast).
    """
    outputs: dict[int, SchedulerOutput] = field(default_factory=dict)
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    broadcast: dict[int, np.ndarray] = field(default_factory=dict)


class SimRank:
    """Device model of rank ``rank`` of ``pp_size``.

    Args:
        rank: PP rank.
        pp_size: stages.
        depth: PPHandler depth (pp_size overlapped, 1 sync).
        max_num_reqs: slots.
        checker: receives ground truth and records violations.
        kv_geometry: ``(max_model_len, num_blocks, block_size)`` of the KV cache model.
    """

    def __init__(self, rank: int, pp_size: int, depth: int, max_num_reqs: int,
                 checker: "InvariantChecker",
                 kv_geometry: tuple[int, int, int] = (2048, 2048, 16)) -> None:
        self.rank, self.is_last, self.checker = rank, rank == pp_size - 1, checker
        self.owner: list[str | None] = [None] * max_num_reqs       # [max_num_reqs]
        self.history: list[list[int]] = [[] for _ in range(max_num_reqs)]  # sampled ids per slot
        self.sample_seed = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self.eos_at = np.full(max_num_reqs, -1, dtype=np.int64)    # [max_num_reqs]
        self.last_prompt = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] "device"
        self.mirror = CpuMirror(max_num_reqs, rank=rank)
        self.handler = None if self.is_last else PPHandler(depth, max_num_reqs, rank=rank)
        self.kv = SimKV(rank, max_num_reqs, *kv_geometry, checker)
        self.next_step = 0          # next step this rank will run
        self.busy_until = -1        # tick the running step ends (-1: idle)
        self.running: int | None = None
        self.finished: dict[int, int] = {}  # step -> tick it finished here
        self.busy_ticks = 0

    def run_step(self, out: SchedulerOutput, wire: "Wire") -> StepResult | None:
        """Apply step ``out`` on this rank; the last rank returns the StepResult."""
        buffers, outputs = wire.broadcast, wire.outputs
        if self.handler is not None:
            self._consume(buffers, outputs)
        if out.freed or out.new_requests:
            self._apply_freed_and_new(out)
        self.kv.apply_deltas(out)
        self.checker.check_inputs(self.rank, out, self.owner, self.history)
        if self.rank == 0:
            wire.hidden[out.step] = self._input_tokens(out)
        self._forward(out)
        if self.is_last:
            result = self._sample(out, wire.hidden.pop(out.step))
            buffers[out.step] = result.sampled_token_ids[:, 0].copy()
            self.checker.record_post(out, self.rank, should_broadcast(out))
            return result
        mask = need_sampled_mask(out) if out.num_rows else None
        self.handler.enqueue(out.step, out, mask, handle=out.step)
        self.checker.record_post(out, self.rank, mask is not None, mask)
        return None

    def _consume(self, buffers: dict[int, np.ndarray],
                 outputs: dict[int, SchedulerOutput]) -> None:
        entry = self.handler.consume()
        if entry is None:
            return
        tokens = buffers[entry.step]           # [num_rows] broadcast of that step
        src = outputs[entry.step]
        for i, idx in enumerate(entry.idx_mapping.tolist()):
            if idx < 0:
                continue
            self.checker.check_apply(self.rank, entry.step, src.req_ids[i], idx, self.owner[idx])
            self.history[idx].append(int(tokens[i]))
        self.mirror.apply_rejected(entry.idx_mapping, np.zeros(len(entry.idx_mapping), np.int64))

    def _apply_freed_and_new(self, out: SchedulerOutput) -> None:
        for f in out.freed:
            self.checker.check_owner(self.rank, out.step, f.slot, f.req_id, self.owner[f.slot])
            self.owner[f.slot] = None
            if self.handler is not None:
                self.handler.on_slot_freed(f.slot)
        for n in out.new_requests:
            self.checker.check_owner(self.rank, out.step, n.slot, None, self.owner[n.slot])
            self.owner[n.slot] = n.req_id
            kept = n.num_output_tokens   # outputs prefilled again after a preemption
            self.history[n.slot] = list(n.prompt_token_ids[len(n.prompt_token_ids) - kept:])
            self.sample_seed[n.slot] = n.sampling["seed"]
            self.eos_at[n.slot] = n.sampling["eos_at"]
            self.last_prompt[n.slot] = n.prompt_token_ids[-1]
            self.num_computed[n.slot] = n.num_cached_tokens
            self.mirror.add_request(n.slot, len(n.prompt_token_ids), n.max_seq_len,
                                    n.num_cached_tokens)
            self.kv.on_new(n.slot)

    def _forward(self, out: SchedulerOutput) -> None:
        if out.num_rows == 0:
            return
        self.kv.forward(out)
        slots = out.slots.astype(np.int64)
        n = out.num_scheduled_tokens.astype(np.int64)
        np.add.at(self.num_computed, slots, n)
        self.mirror.apply_scheduled(slots, n)
        bad = np.nonzero(self.mirror.num_computed_tokens_np[slots] != self.num_computed[slots])[0]
        if bad.size:
            self.checker.violation(4, out.step, self.rank, f"mirror num_computed_tokens of slot "
                                   f"{int(slots[bad[0]])} differs from the device")

    def _input_tokens(self, out: SchedulerOutput) -> np.ndarray:
        """Rank 0's input token of each sampling row: ``[num_rows]`` (last sampled id of the
        slot's request, or the last prompt id for a final chunk; -1 for non-final chunks).
        It travels to the last rank inside the hidden states and conditions the sampled token."""
        toks = np.full(out.num_rows, -1, dtype=np.int64)    # [num_rows]
        for i in np.nonzero(out.is_final_chunk)[0].tolist():
            slot = int(out.slots[i])
            hist = self.history[slot]
            toks[i] = hist[-1] if hist else int(self.last_prompt[slot])
        return toks

    def _sample(self, out: SchedulerOutput, inputs: np.ndarray) -> StepResult:
        n = out.num_rows
        sampled = np.zeros((n, 1), dtype=np.int64)          # [num_rows, 1]
        for i in np.nonzero(out.is_final_chunk)[0].tolist():
            slot = int(out.slots[i])
            hist = self.history[slot]
            tok = model_token(int(self.sample_seed[slot]), len(hist), int(inputs[i]),
                              int(self.eos_at[slot]))
            hist.append(tok)
            sampled[i, 0] = tok
        self.checker.record_sampled(out, sampled[:, 0])
        return StepResult(out.step, sampled, out.is_final_chunk.astype(np.int32),
                          np.zeros(n, dtype=np.int32))
