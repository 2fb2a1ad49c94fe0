"""Request-side types of the scheduler: what a client submits, what it gets back, and the lifecycle
model the ``specs/request.yaml`` machine drives.

The :class:`Request` object carries only identity and lifecycle state; per-token progress lives in
the scheduler's slot-indexed numpy arrays (:class:`ppstate.budget.RequestArrays`), which the guard
methods read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppstate.budget import RequestArrays

#: finish_reason of a TokenUpdate / the client-visible reason per final lifecycle state.
FINISH_REASONS = {"finished_stopped": "stop", "finished_length": "length",
                  "finished_aborted": "abort"}


@dataclass(frozen=True)
class RequestSpec:
    """One generation job as submitted.

    Attributes:
        req_id: unique id.
        prompt_token_ids: prompt tokens (non-empty, fewer than ``max_model_len``).
        max_tokens: new tokens allowed (>= 1); capped at ``max_model_len - prompt_len``.
        eos_token_ids: tokens that stop the request (unless ``ignore_eos``).
        stop_token_ids: tokens that always stop the request.
        ignore_eos: do not stop on ``eos_token_ids``.
        sampling: opaque runtime sampling parameters, copied into ``NewRequest.sampling``.
        fork_of: id of a request with the same prompt this one is forked from (``n`` > 1): it is
            admitted only once that parent's prefill is fully scheduled, so the prefix cache gives
            it every full block of the prompt (shared by reference count, not recomputed).
        prefix_cache: take prefix-cache hits (False: compute every prompt token, e.g. when the
            logprobs of every prompt position are asked for; its blocks are still registered).
    """
    req_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)
    fork_of: str | None = None
    prefix_cache: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def stop_reason(self, token: int) -> str | None:
        """"stop" when ``token`` ends the request (EOS unless ignored, or a stop token id)."""
        if token in self.stop_token_ids or (not self.ignore_eos and token in self.eos_token_ids):
            return "stop"
        return None


@dataclass
class TokenUpdate:
    """Tokens delivered to a client for one request from one step result.

    Attributes:
        req_id: the request.
        token_ids: new tokens, in order (may be empty only together with a finish_reason).
        finish_reason: "stop" | "length" | "abort" | None (still running).
    """
    req_id: str
    token_ids: list[int]
    finish_reason: str | None


class Request:
    """Lifecycle model of one request (``state`` is written only by the transitions machine).

    Args:
        spec: the submitted request.
        max_tokens: effective max new tokens (already capped by ``max_model_len``).
        arrays: the scheduler's per-slot progress arrays, read by the guards.
        order: admission-order key (FCFS arrival counter).
    """

    state: str

    def __init__(self, spec: RequestSpec, max_tokens: int, arrays: "RequestArrays",
                 order: int) -> None:
        self.req_id = spec.req_id
        self.spec = spec
        self.max_tokens = max_tokens
        self.order = order
        self.slot = -1
        self._arrays = arrays
        # received tokens, kept across preemption; while the request holds a slot, those
        # before its admission (the scheduler's out_tokens row has them all, and gives them
        # back when the request leaves its slot)
        self.output_token_ids: list[int] = []
        self.prefill_tokens: tuple[int, ...] = spec.prompt_token_ids  # prompt + outputs at admission
        self.block_hashes: list[int] = []       # chained hashes of prefill_tokens' full blocks
        self.num_registered = 0                 # leading blocks registered in the prefix cache
        self.epoch = 0                          # scheduler-unique id of its latest admission (older rows are stale)

    @property
    def prompt_len(self) -> int:
        return self.spec.prompt_len

    def has_slot(self) -> bool:
        """Guard of ``admit``: a slot has been allocated."""
        return self.slot >= 0

    def prefill_fully_scheduled(self) -> bool:
        """Guard of ``complete_prefill``: every prefill token (prompt, plus the outputs kept
        across a preemption) is in a scheduled chunk."""
        return self.has_slot() and \
            int(self._arrays.num_computed_tokens[self.slot]) >= len(self.prefill_tokens)

    def __repr__(self) -> str:
        return f"Request({self.req_id!r}, state={getattr(self, 'state', '?')}, slot={self.slot})"
