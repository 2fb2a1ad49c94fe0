"""The last rank's sampling of one step: logits -> the step's :class:`SampledPayload`.

:class:`StepSampler` is owned by :class:`~runtime.worker.runner.StageRunner` (the last rank's
``RankBackend.sample``). It takes back the prompt-logprob plan of the step (one logit row per
step row again), applies the grammar bitmask, and samples the rows that sample: through the
speculative verifier when the step holds drafts (#14), else one id per row with the request's
sampling parameters and, where a penalty needs it, the slots' token history.
"""

from __future__ import annotations

import numpy as np
import torch

from ppstate.batch import SchedulerOutput
from ppstate.payload import SampledPayload
from runtime.host_copy import to_device
from runtime.sampling.penalties import TokenHistory
from runtime.sampling.prompt_logprobs import PendingPrompt
from runtime.sampling.sampler import sample
from runtime.sampling.speculative_verify import SpecDecoder, logprob_rows as spec_logprob_rows
from runtime.worker.device_state import DeviceState
from runtime.worker.grammar_hooks import GrammarHooks
from runtime.worker.pending_result import LogprobRows, ReadyLogprobs
from runtime.worker.step_forward import ForwardPath


class StepSampler:
    """Samples a step's rows into its payload (the last rank only).

    Args:
        state: the rank's device state (sampling state, token history).
        fwd: the rank's forward path (its ``prompt_plan`` of the step, taken here).
        spec: speculative decoding hooks, or None.
        grammar: structured-output hooks, or None.
    """

    def __init__(self, state: DeviceState, fwd: ForwardPath, spec: SpecDecoder | None,
                 grammar: GrammarHooks | None) -> None:
        self.state, self.fwd, self.spec, self.grammar = state, fwd, spec, grammar
        self.device = state.device

    def run(self, out: SchedulerOutput, mask: np.ndarray | None, logits: torch.Tensor | None,
            payload: SampledPayload) -> tuple[LogprobRows | None, PendingPrompt | None]:
        """Fill ``payload`` (``[num_rows, width + 2]`` int64, zeros on entry; ``num_rows`` > 0)
        for the rows ``mask`` selects (None: no row samples). Returns the step's logprob rows
        (None when nothing sampled) and its prompt logprobs (None without a plan)."""
        logprobs, prompt_lps = None, None
        r = out.num_rows
        if self.fwd.prompt_plan is not None:   # back to one logit row per step row
            logits, prompt_lps = self.fwd.prompt_plan.split(logits, self.state.all_token_ids)
            self.fwd.prompt_plan = None
        if mask is not None and self.grammar is not None:
            self.grammar.mask(logits)
        spec = self.spec if self.spec is not None and self.spec.rows.any_drafts else None
        if mask is not None and spec is not None:  # speculative decoding (#14)
            v, rows = self.spec.sample(out, mask, logits, self.state, payload.buf)
            if self.grammar is not None:
                self.grammar.accept_spec(out.slots[rows], v.token_ids, v.num_sampled)
            ks = self.state.sampling_state.num_logprobs_np[out.slots[rows]]
            logprobs = ReadyLogprobs(spec_logprob_rows(v, rows, r, ks))
        elif mask is not None:
            logprobs = self._sample_plain(out, mask, logits, payload)
        return logprobs, prompt_lps

    def _sample_plain(self, out: SchedulerOutput, mask: np.ndarray, logits: torch.Tensor,
                      payload: SampledPayload) -> LogprobRows:
        """One id per sampling row (no drafts in the step)."""
        r = out.num_rows
        rows = np.flatnonzero(mask)
        s_rows = out.slots[rows]
        # a step without drafts under --spec-tokens: the rank's corrected starts (#33)
        starts = out.start_positions if self.spec is None else self.spec.rows.starts
        batch, slots_t = self.state.sampling_state.batch(
            s_rows, starts[rows] + out.num_scheduled_tokens[rows])
        history = None
        if batch.penalty_rows is not None:  # penalties read the slots' token history
            history = TokenHistory.gather(self.state.all_token_ids, self.state.prefill_len,
                                          self.state.total_len, slots_t[batch.penalty_rows])
        if rows.size < r:
            rows_t = to_device(rows, self.device, torch.int64)
            so = sample(logits.index_select(0, rows_t).float(), batch, history)
            payload.token_ids[rows_t, 0] = so.token_ids
            payload.num_sampled[rows_t] = 1
        else:   # every row samples (decode steps): no row gather
            so = sample(logits.float(), batch, history)
            payload.token_ids[:, 0] = so.token_ids
            payload.num_sampled[:] = 1
        if self.grammar is not None:
            self.grammar.accept_plain(s_rows, so.token_ids)
        return LogprobRows.of(so, rows, r, self.state.sampling_state.num_logprobs_np[s_rows])
