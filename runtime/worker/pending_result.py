"""The last rank's result of one step, before its sampled ids have reached the host.

:meth:`StageRunner.launch <runtime.worker.runner.StageRunner.launch>` returns a
:class:`PendingResult` as soon as the step's kernels and the device-to-host copy of its payload are
enqueued; :meth:`PendingResult.result` waits for the copy's event and builds the
:class:`~ppstate.batch.StepResult` the engine receives. The worker launches the next step in
between when it has one (docs/gpu.md, "A step with no host stall").
"""

from __future__ import annotations


import numpy as np
import torch

from ppstate.batch import StepResult
from ppstate.payload import SampledPayload
from runtime.host_copy import PendingCopy
from runtime.sampling.sampler import SamplerOutput
from runtime.sampling.step_logprobs import StepLogprobs


def sampled_fields(copy: PendingCopy) -> dict:
    """The trace's ``sampled`` event's ``token_ids`` and ``num_sampled`` (docs/trace_format.md;
    the step order adds ``req_ids``) once ``copy`` (a step's payload ``[num_rows, width + 2]`` on
    its way to pinned host memory) has landed; waits for it."""
    h = SampledPayload(copy.wait())
    return {"token_ids": h.token_ids.tolist(), "num_sampled": h.num_sampled.tolist()}


class PendingResult:
    """A launched step of the last rank.

    Args:
        step: the step number.
        width: sampled ids per row (payload columns ``[0, width)``; ``width`` = count of sampled,
            ``width + 1`` = count of rejected).
        copy: the payload ``[num_rows, width + 2]`` int64 on its way to the host.
        logprobs: :class:`LogprobRows` (or :class:`ReadyLogprobs`) of the step, or None.
        busy_s: seconds the rank computed to launch the step (host side).
        prompt_logprobs: the step's prompt logprobs still on the device
            (:class:`~runtime.sampling.prompt_logprobs.PendingPrompt`), or None.
    """

    def __init__(self, step: int, width: int, copy: PendingCopy,
                 logprobs: "LogprobRows | None", busy_s: float, prompt_logprobs=None) -> None:
        self.step, self.width, self.copy, self.logprobs = step, width, copy, logprobs
        self.busy_s, self.prompt_logprobs = busy_s, prompt_logprobs
        self._result: StepResult | None = None

    @classmethod
    def completed(cls, result: StepResult) -> "PendingResult":
        """A step whose result is known without the device (a step without rows)."""
        p = cls(result.step, 1, PendingCopy(torch.zeros((0, 3), dtype=torch.int64), None), None, 0.0)
        p._result = result
        return p

    def ready(self) -> bool:
        """Whether the sampled ids have landed (never blocks)."""
        return self._result is not None or self.copy.ready()

    def result(self) -> StepResult:
        """Wait for the sampled ids and return the step's result (cached after the first call)."""
        if self._result is None:
            host, w = self.copy.wait(), self.width
            lps = None if self.logprobs is None else self.logprobs.entries()
            plps = None if self.prompt_logprobs is None else self.prompt_logprobs.host()
            self._result = StepResult(self.step, host[:, :w].copy(), host[:, w].astype(np.int32),
                                      host[:, w + 1].astype(np.int32), lps, plps)
        return self._result


class LogprobRows:
    """Per-row logprob payload of a step, read from the device when the result is built.

    Args:
        so: the sampler's output for the sampled rows (``logprobs`` ``[S]``, ``top_logprobs``
            ``([S, k], [S, k])``).
        rows: ``[S]`` step rows that sampled.
        num_rows: rows of the step.
        ks: ``[S]`` logprob alternatives each row asked for, -1 = no logprobs.
    """

    def __init__(self, so: SamplerOutput, rows: np.ndarray, num_rows: int, ks: np.ndarray) -> None:
        self.so, self.row_ids, self.num_rows, self.ks = so, rows, num_rows, ks

    @classmethod
    def of(cls, so: SamplerOutput, rows: np.ndarray, num_rows: int,
           ks: np.ndarray) -> "LogprobRows | None":
        """None when no row asked for logprobs."""
        if so.logprobs is None or not (ks >= 0).any():
            return None
        return cls(so, rows, num_rows, ks)

    def entries(self) -> StepLogprobs:
        """The entries of the rows that asked for logprobs, as arrays (one device-to-host copy
        per array, no per-row Python)."""
        so, sel = self.so, np.flatnonzero(self.ks >= 0)
        ks = self.ks[sel].astype(np.int32)
        k = int(ks.max())
        sel_t = torch.from_numpy(sel).to(so.logprobs.device, non_blocking=True)
        lp = so.logprobs.index_select(0, sel_t).float().cpu().numpy()
        if so.top_logprobs is not None and k > 0:
            ids = so.top_logprobs[0][:, :k].index_select(0, sel_t).cpu().numpy()
            vals = so.top_logprobs[1][:, :k].index_select(0, sel_t).float().cpu().numpy()
        else:
            ids, vals = np.zeros((sel.size, 0), np.int64), np.zeros((sel.size, 0), np.float32)
            ks = np.minimum(ks, 0)
        return StepLogprobs(self.row_ids[sel].astype(np.int32), lp, ks, ids.astype(np.int64),
                            vals.astype(np.float32))


class ReadyLogprobs:
    """Logprob entries already built on the host (speculative decoding's verify), with the
    :class:`LogprobRows` interface."""

    def __init__(self, entries: list | None) -> None:
        self._entries = entries

    def entries(self) -> list | None:
        """``[num_rows]`` entries as :meth:`LogprobRows.entries` returns them (a list per row of
        emitted tokens for rows that carried drafts)."""
        return self._entries
