"""Slot-indexed views of the running requests, owned by the scheduler and shared by reference.

Written only on lifecycle events (admit, complete_prefill, preempt, finish), so that a step's
decode rows and results are handled with array operations (vLLM v1 worker/gpu style), not per
request. The scheduler creates one :class:`SlotViews`; its queues
(:class:`~ppstate.scheduler_queues.RequestQueues`), its row builder
(:class:`~ppstate.scheduler_rows.RowBuilder`) and its result handler
(:class:`~ppstate.scheduler_results.StepResults`) receive the same object as a field and read or
write its arrays in place.
"""

from __future__ import annotations

import numpy as np

from ppstate.budget import RequestArrays
from ppstate.request import Request


class SlotViews:
    """The views of ``max_num_seqs`` slots.

    Attributes:
        slot_epoch: ``[max_num_reqs]`` int64 admission epoch of the occupant, 0 = free.
        decoding: ``[max_num_reqs]`` bool, the occupant is decoding.
        slot_req: ``[max_num_reqs]`` the occupant (None: free).
        out_tokens: ``[max_num_reqs, max_model_len]`` int32, the occupant's output token ids
            (its first ``num_output_tokens``; zeros elsewhere and in free rows): one indexed write
            per step instead of a list append per row; ``Request.output_token_ids`` gets them on
            vacate. int32 as vLLM's ``token_ids_cpu`` (4 * max_num_seqs * max_model_len bytes,
            e.g. 8 MiB at 256 x 8,192; ``np.zeros`` maps untouched pages lazily).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int) -> None:
        n = max_num_seqs
        self.slot_epoch = np.zeros(n, dtype=np.int64)
        self.decoding = np.zeros(n, dtype=bool)
        self.slot_req: list[Request | None] = [None] * n
        self.out_tokens = np.zeros((n, max_model_len), dtype=np.int32)

    def occupy(self, req: Request, n_out: int) -> None:
        """``req`` was admitted into ``req.slot`` with ``n_out`` output tokens kept (re-admission
        after a preemption: its ``output_token_ids``)."""
        self.slot_epoch[req.slot], self.slot_req[req.slot] = req.epoch, req
        if n_out:
            self.out_tokens[req.slot, :n_out] = req.output_token_ids

    def vacate(self, slot: int, arrays: RequestArrays) -> None:
        """Clear the views of ``slot`` (its request finished or was preempted); its request's
        ``output_token_ids`` get the tokens of its ``out_tokens`` row (``arrays``: the per-slot
        progress, read for the number of output tokens)."""
        req, n = self.slot_req[slot], int(arrays.num_output_tokens[slot])
        if req is not None and n:
            req.output_token_ids[:] = self.out_tokens[slot, :n].tolist()
            self.out_tokens[slot, :n] = 0
        self.slot_epoch[slot], self.decoding[slot], self.slot_req[slot] = 0, False, None
