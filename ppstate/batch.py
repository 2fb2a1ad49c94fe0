"""The single contract between the scheduler and the runtime: :class:`SchedulerOutput`.

Every rank receives the same SchedulerOutput for a step, so every rank-replicated decision
(need-sampled mask, broadcast or skip) is a pure function of it (invariant 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class NewRequest:
    """A request admitted in this step: workers initialise its slot before the forward.

    Attributes:
        req_id: request id.
        slot: slot (``req_idx``) it occupies.
        prompt_token_ids: tokens to prefill (``prefill_len`` of them): the prompt, followed by
            the ``num_output_tokens`` tokens it already received when re-admitted after preemption.
        max_seq_len: prompt length + max new tokens (tokens), already capped by max_model_len.
        sampling: opaque runtime sampling parameters (temperature, top_p, seed, ...).
        num_cached_tokens: leading tokens already in the KV cache (prefix-cache hit); the first
            chunk starts there.
        num_output_tokens: output tokens included at the end of ``prompt_token_ids`` (the next
            sampled token is output number ``num_output_tokens``, 0-based).
    """
    req_id: str
    slot: int
    prompt_token_ids: tuple[int, ...]
    max_seq_len: int
    sampling: dict[str, Any] = field(default_factory=dict)
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(frozen=True)
class FreedSlot:
    """A request that left its slot; workers free ``slot`` (bumping its generation)."""
    req_id: str
    slot: int
    reason: str  # finished state name ("finished_stopped", ...) or "preempted"


def _no_deltas() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's batch. Rows are ordered as the runtime lays tokens out (flat, row after row).

    Attributes:
        step: step number; increasing from one issued step to the next. A number whose step
            would carry nothing (:attr:`carries_nothing`) is skipped, not issued: every rank
            rotates its PPHandler over it as over an empty step (docs/design.md §5).
        req_ids: ``[num_rows]`` request id per row.
        slots: ``[num_rows]`` int32 slot per row (``idx_mapping``).
        num_scheduled_tokens: ``[num_rows]`` int32 query length per row (tokens).
        start_positions: ``[num_rows]`` int32 ``num_computed_tokens`` of the row's request before
            this step, i.e. the position of its first scheduled token.
        is_final_chunk: ``[num_rows]`` bool; True for decode rows and final prefill chunks, i.e.
            the rows whose sampled token someone needs (the need-sampled mask).
        new_requests: requests admitted in this step (initialise their slots first).
        freed: requests that finished, were aborted or preempted since the previous step (free
            first).
        block_table_slots, block_table_cols, block_table_ids: ``[U]`` int32 block-table deltas,
            applied after ``freed`` and ``new_requests``: ``block_table[slot, col] = id``. A
            slot's row starts empty on admission; every rank applies the same deltas, so all
            hold identical tables (invariant 9).
        block_digests: ``[num_rows]`` int64 digest of the block ids of each row's slot after
            this step's deltas, as the scheduler decided them (:mod:`ppstate.block_digest`);
            every rank compares its own table rows with it before the forward. None: not sent
            (an output built by hand), nothing to compare.
    """
    step: int
    req_ids: tuple[str, ...]
    slots: np.ndarray
    num_scheduled_tokens: np.ndarray
    start_positions: np.ndarray
    is_final_chunk: np.ndarray
    new_requests: tuple[NewRequest, ...] = ()
    freed: tuple[FreedSlot, ...] = ()
    block_table_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    block_table_cols: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    block_table_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    block_digests: np.ndarray | None = None

    def __init__(self, step: int, req_ids: tuple[str, ...], slots: np.ndarray,
                 num_scheduled_tokens: np.ndarray, start_positions: np.ndarray,
                 is_final_chunk: np.ndarray, new_requests: tuple[NewRequest, ...] = (),
                 freed: tuple[FreedSlot, ...] = (), block_table_slots: np.ndarray | None = None,
                 block_table_cols: np.ndarray | None = None,
                 block_table_ids: np.ndarray | None = None,
                 block_digests: np.ndarray | None = None) -> None:
        # written out: the generated __init__ of a frozen dataclass calls object.__setattr__
        # once per field, about ten times slower, and every step makes one (fields in order)
        d = self.__dict__
        d["step"], d["req_ids"], d["slots"] = step, req_ids, slots
        d["num_scheduled_tokens"], d["start_positions"] = num_scheduled_tokens, start_positions
        d["is_final_chunk"], d["new_requests"], d["freed"] = is_final_chunk, new_requests, freed
        d["block_table_slots"] = _no_deltas() if block_table_slots is None else block_table_slots
        d["block_table_cols"] = _no_deltas() if block_table_cols is None else block_table_cols
        d["block_table_ids"] = _no_deltas() if block_table_ids is None else block_table_ids
        d["block_digests"] = block_digests

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    @property
    def total_tokens(self) -> int:
        """Tokens in the batch (sum of query lengths)."""
        return int(self.num_scheduled_tokens.sum())

    @property
    def is_empty(self) -> bool:
        return self.num_rows == 0

    @property
    def carries_nothing(self) -> bool:
        """No rows, no freed slot, no admitted request, no block-table delta: the scheduler
        skips such a step's number instead of issuing it."""
        return not (self.req_ids or self.freed or self.new_requests or
                    self.block_table_slots.size)

    @staticmethod
    def empty(step: int, new_requests: tuple[NewRequest, ...] = (),
              freed: tuple[FreedSlot, ...] = ()) -> "SchedulerOutput":
        """A step with no rows (it still advances every rank's PPHandler FIFO)."""
        z = np.zeros(0, dtype=np.int32)
        return SchedulerOutput(step, (), z, z.copy(), z.copy(), np.zeros(0, dtype=bool),
                               new_requests, freed)


@dataclass(frozen=True)
class StepResult:
    """What the last rank returns for one step.

    Attributes:
        step: the step.
        sampled_token_ids: ``[num_rows, width]`` int64 sampled ids (``width`` = 1 + k with k
            speculative tokens; 1 without). Rows that are non-final chunks hold garbage.
        num_sampled: ``[num_rows]`` int32 valid ids per row (0 for non-final chunks).
        num_rejected: ``[num_rows]`` int32 rejected speculative tokens per row (0 without).
        logprobs: optional payload (runtime-defined: per-row entries or arrays of the rows
            that asked).
    """
    step: int
    sampled_token_ids: np.ndarray
    num_sampled: np.ndarray
    num_rejected: np.ndarray
    logprobs: Any = None

    def __init__(self, step: int, sampled_token_ids: np.ndarray, num_sampled: np.ndarray,
                 num_rejected: np.ndarray, logprobs: Any = None) -> None:
        d = self.__dict__   # written out, as SchedulerOutput's: one per step
        d["step"], d["sampled_token_ids"], d["num_sampled"] = step, sampled_token_ids, num_sampled
        d["num_rejected"], d["logprobs"] = num_rejected, logprobs
