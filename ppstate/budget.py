"""Scheduler configuration, per-slot progress arrays and the per-step budget.

Budgets follow vLLM's scheduler: ``max_num_seqs`` live requests (= slots), ``max_num_batched_tokens``
per step, ``max_prefill_chunk`` tokens per prefill chunk (``long_prefill_token_threshold``) and
``max_model_len``. Balanced admission (vLLM RFC #50853): in overlapped mode a batch holds at most
``ceil(max_num_seqs / pp_size)`` rows, so a burst is spread over the ``pp_size`` in-flight batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from ppstate import mutants
from ppstate.errors import SchedulerError
from ppstate.step_cost import CPU_DEFAULTS, model_of


@dataclass(frozen=True)
class SchedulerConfig:
    """Static scheduler parameters.

    Attributes:
        pp_size: pipeline stages (>= 1).
        max_num_seqs: live requests at most; also the number of slots (>= 1).
        max_num_batched_tokens: tokens per step at most (>= 1).
        max_prefill_chunk: tokens per prefill chunk at most (>= 1).
        max_model_len: prompt + generated tokens at most (>= 2).
        mode: "overlapped" (pp_size + 1 batches in flight) or "sync" (one batch, the baseline).
        block_size: tokens per KV-cache block (>= 1).
        num_kv_blocks: KV blocks per rank; None = room for ``max_model_len`` tokens in every slot
            (``max_num_seqs * ceil(max_model_len / block_size)``, the old slot cache's capacity).
        enable_prefix_caching: reuse cached full prompt blocks across requests.
        adaptive_lanes: overlapped mode fills only as many lanes as the step-cost model says
            are faster (:mod:`ppstate.lanes`); off: all ``pp_size`` lanes.
        dynamic_chunks: prefill chunks of equal estimated time as the prefix grows
            (:mod:`ppstate.chunk_sizing`); off: ``max_prefill_chunk`` tokens each.
        cost_base_s, cost_per_row_s, cost_per_token_s, cost_per_prefix_token_s, cost_concurrency:
            the step-cost model (:class:`ppstate.step_cost.StepCostModel`, seconds) used by both.
        num_spec_tokens: speculative (n-gram) draft tokens per decode row, ``K`` (0: off). A
            decode row then carries ``1 + k`` tokens, ``k <= K`` (:func:`ppstate.speculative.drafts_for_row`).
        spec_probe_ngram: ``n`` > 0: a decode row gets drafts only when its request's last ``n``
            tokens occur earlier in its history (:mod:`ppstate.speculative_probe`); 0: always.

    Raises:
        SchedulerError: a field out of range; the message names the field.
    """
    pp_size: int = 2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_prefill_chunk: int = 64
    max_model_len: int = 2048
    mode: Literal["overlapped", "sync"] = "overlapped"
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # ---- issue 11: step-cost model, adaptive lanes, dynamic chunk sizing (ppstate.step_cost,
    # ppstate.lanes, ppstate.chunk_sizing) ----
    adaptive_lanes: bool = False
    dynamic_chunks: bool = False
    cost_base_s: float = CPU_DEFAULTS["base_s"]
    cost_per_row_s: float = CPU_DEFAULTS["per_row_s"]
    cost_per_token_s: float = CPU_DEFAULTS["per_token_s"]
    cost_per_prefix_token_s: float = CPU_DEFAULTS["per_prefix_token_s"]
    cost_concurrency: float = CPU_DEFAULTS["concurrency"]
    # ---- end issue 11 ----
    num_spec_tokens: int = 0  # speculative decoding (issue #14)
    spec_probe_ngram: int = 0  # issue #33: no drafts for rows whose n-gram has no match

    def __post_init__(self) -> None:
        if self.num_kv_blocks is None and isinstance(self.block_size, int) and self.block_size > 0:
            per_req = -(-self.max_model_len // self.block_size)
            object.__setattr__(self, "num_kv_blocks", self.max_num_seqs * per_req)
        for name, low in (("pp_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                          ("max_prefill_chunk", 1), ("max_model_len", 2), ("block_size", 1),
                          ("num_kv_blocks", 1), ("num_spec_tokens", 0),
                          ("spec_probe_ngram", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise SchedulerError(f"SchedulerConfig.{name} must be an int >= {low}, got {value!r}")
        if self.mode not in ("overlapped", "sync"):
            raise SchedulerError(f"SchedulerConfig.mode must be 'overlapped' or 'sync', "
                                 f"got {self.mode!r}")
        try:  # issue 11: the step-cost coefficients
            model_of(self)
        except (TypeError, ValueError) as exc:
            raise SchedulerError(f"SchedulerConfig.cost_*: {exc}") from None

    def output_room(self, prompt_len: int) -> int:
        """New tokens a prompt of ``prompt_len`` tokens leaves room for: ``max_model_len -
        prompt_len``. The prompt-length rule, in one place: a prompt is accepted only if this is
        >= 1, and a request's new tokens are capped at it (scheduler, engine, server, generate)."""
        return self.max_model_len - prompt_len

    @property
    def watermark_blocks(self) -> int:
        """Blocks an admission must leave free for running requests (1%, vLLM's default)."""
        return self.num_kv_blocks // 100

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds in all (``num_kv_blocks * block_size``)."""
        return self.num_kv_blocks * self.block_size

    @cached_property  # fields are frozen: computed once per config
    def in_flight_limit(self) -> int:
        """Steps issued and not yet answered: pp_size + 1 overlapped, 1 sync."""
        return self.pp_size + 1 if self.mode == "overlapped" else 1

    @property
    def cadence(self) -> int:
        """Steps between two sampling rows of one request: pp_size overlapped, 1 sync."""
        if mutants.active("short_cadence") and self.mode == "overlapped":  # model checker's mutant
            return self.pp_size - 1
        return self.pp_size if self.mode == "overlapped" else 1

    @cached_property  # fields are frozen: computed once per config
    def max_rows_per_step(self) -> int:
        """Balanced-admission row cap with all lanes open: ceil(max_num_seqs / pp_size)
        overlapped, max_num_seqs sync (with fewer lanes: :func:`ppstate.lanes.lane_row_cap`)."""
        if self.mode == "sync":
            return self.max_num_seqs
        return -(-self.max_num_seqs // self.pp_size)


    @cached_property  # fields are frozen: computed once per config
    def step_token_budget(self) -> int:
        """Tokens one step may schedule (the PP throttle).

        Sync: ``max_num_batched_tokens``. Overlapped: ``pp_size`` batches are in the pipeline at
        once, so a step gets ``ceil(max_num_batched_tokens / pp_size)`` (at least the row cap, at
        most ``max_num_batched_tokens``): the tokens in flight stay within the budget and no single
        heavy batch stalls the ``pp_size - 1`` light ones behind it (the deferred receive makes
        rank 0 wait for the last rank ``pp_size`` steps back). vLLM's PP PR throttles the same way.
        """
        if self.mode == "sync":
            return self.max_num_batched_tokens
        share = -(-self.max_num_batched_tokens // self.pp_size)
        return min(self.max_num_batched_tokens, max(share, self.max_rows_per_step))


class RequestArrays:
    """Per-token progress of live requests, indexed by slot (all ``[max_num_reqs]`` int64).

    Fields: ``num_computed_tokens`` (tokens scheduled so far = position of the next row's first
    token), ``prefill_len`` (prompt tokens), ``max_tokens`` (effective new-token limit),
    ``num_sampling_rows`` (output tokens the scheduled sampling rows may produce: 1 per final
    chunk, 1 + drafts per decode row, minus the rejected drafts once their result arrived; without
    speculation simply the sampling rows), ``num_output_tokens``
    (tokens received), ``next_eligible_step`` (first step the request may run again).
    """

    FIELDS = ("num_computed_tokens", "prefill_len", "max_tokens", "num_sampling_rows",
              "num_output_tokens", "next_eligible_step")

    def __init__(self, max_num_reqs: int) -> None:
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self.prefill_len = np.zeros(max_num_reqs, dtype=np.int64)          # [max_num_reqs]
        self.max_tokens = np.zeros(max_num_reqs, dtype=np.int64)           # [max_num_reqs]
        self.num_sampling_rows = np.zeros(max_num_reqs, dtype=np.int64)    # [max_num_reqs]
        self.num_output_tokens = np.zeros(max_num_reqs, dtype=np.int64)    # [max_num_reqs]
        self.next_eligible_step = np.zeros(max_num_reqs, dtype=np.int64)   # [max_num_reqs]

    def reset(self, slot: int, prefill_len: int, max_tokens: int, step: int,
              num_cached: int = 0, num_output: int = 0) -> None:
        """Initialise ``slot`` for a request admitted at ``step`` whose first ``num_cached``
        prefill tokens are prefix-cache hits and which already received ``num_output`` tokens
        (re-admission after preemption: they are part of its ``prefill_len``)."""
        for name in self.FIELDS:
            getattr(self, name)[slot] = 0
        self.prefill_len[slot] = prefill_len
        self.max_tokens[slot] = max_tokens
        self.next_eligible_step[slot] = step
        self.num_computed_tokens[slot] = num_cached
        self.num_output_tokens[slot] = num_output
        self.num_sampling_rows[slot] = num_output


class StepBudget:
    """What is left of one step's budget while rows are added.

    Args:
        tokens: ``max_num_batched_tokens``.
        rows: row cap of the step (``SchedulerConfig.max_rows_per_step``).
    """

    def __init__(self, tokens: int, rows: int) -> None:
        self.tokens, self.rows = tokens, rows

    def can_add(self) -> bool:
        return self.tokens > 0 and self.rows > 0

    def take(self, num_scheduled_tokens: int, counts_row: bool = True) -> None:
        """Account one row of ``num_scheduled_tokens`` tokens (``counts_row``: against the row
        cap)."""
        self.tokens -= num_scheduled_tokens
        self.rows -= int(counts_row)
