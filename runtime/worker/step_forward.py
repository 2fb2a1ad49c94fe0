"""The model side of one rank's step: its batch metadata and the stage forward that reads it.

:class:`ForwardPath` is owned by :class:`~runtime.worker.runner.StageRunner`. It builds a step's
:class:`~runtime.model.stage.BatchMeta` (with the speculative rank's corrected starts, a verify
step's padded graph inputs, the widened logits of prompt logprobs, the grammar bitmask fill) and
runs the stage: the reference ``StageModel.forward``, or on the fast path a decode-only step
through its CUDA graph and any other step eagerly over the Triton kernels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ppstate.batch import SchedulerOutput
from runtime.host_copy import to_device
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.model.stage import BatchMeta, StageModel
from runtime.sampling.prompt_logprobs import PromptLogprobPlan
from runtime.sampling.speculative_verify import SpecDecoder
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.device_state import DeviceState
from runtime.worker.grammar_hooks import GrammarHooks
from runtime.worker.groups import PPGroups
from runtime.worker.step_inputs import build_fast_meta


@dataclass
class StepInputs:
    """What :meth:`ForwardPath.prepare` builds: the batch metadata and, on rank 0, the
    ``[num_tokens]`` input token ids gathered from device state."""
    meta: BatchMeta
    input_ids: torch.Tensor | None


class ForwardPath:
    """Batch metadata and the stage forward of one rank (fields as :class:`StageRunner`'s args).

    State kept between the calls of one step: ``meta`` (of the step being run, read by the
    runner's ``apply_scheduled``), ``prompt_plan`` (the widened logits of prompt logprobs on the
    last rank; the sampler takes it and sets it back to None) and ``verify_in`` (padded inputs of
    a verify step a CUDA graph replays, #33).
    """

    def __init__(self, groups: PPGroups, stage: StageModel, state: DeviceState,
                 fast: PagedStage | None, graphs: DecodeGraphs | None, spec: SpecDecoder | None,
                 grammar: GrammarHooks | None, verify_graphs) -> None:
        self.g, self.stage, self.state = groups, stage, state
        self.fast, self.graphs = fast, graphs
        self.spec, self.grammar, self.verify_graphs = spec, grammar, verify_graphs
        self.device = state.device
        self.meta: BatchMeta | None = None
        self.prompt_plan: PromptLogprobPlan | None = None
        self.verify_in = None

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's inputs (``RankBackend.prepare_inputs``)."""
        starts = out.start_positions
        self.verify_in = None
        if self.spec is not None:  # speculative decoding (#14): own corrected starts, drafts
            starts = self.spec.prepare(out, self.state)
            if self.verify_graphs is not None and self.spec.rows.any_drafts:   # a verify step
                # a CUDA graph holds (#33); a step without drafts is a plain decode step
                self.verify_in = self.verify_graphs.inputs(
                    out.slots, starts, out.num_scheduled_tokens, self.spec.rows.decode,
                    self.state.block_table_np, self.state.block_size)
        if self.fast is None:
            meta = BatchMeta.build(out.slots, starts, out.num_scheduled_tokens,
                                   self.device, torch.from_numpy(self.state.block_table_np),
                                   self.state.block_size, attention_groups=True)
        else:   # numpy arithmetic, two uploads (runtime/worker/step_inputs.py)
            meta = build_fast_meta(out.slots, starts, out.num_scheduled_tokens,
                                   self.state.block_table_np, self.state.block_size, self.device)
        self.meta = meta
        if self.spec is not None and self.g.is_last:
            if self.spec.rows.any_drafts:   # else one logit row per step row, as without
                meta = self.spec.logit_meta(meta, out)
            else:
                self.spec.first = np.arange(out.num_rows, dtype=np.int64)
        elif self.g.is_last:   # prompt logprobs: logits at every token of the scoring rows
            self.prompt_plan = self.state.sampling_state.prompt_logprobs.plan(
                out.slots, starts, out.num_scheduled_tokens)
            if self.prompt_plan is not None:
                meta = dataclasses.replace(meta, last_token=to_device(
                    self.prompt_plan.index.astype(np.int64), self.device, torch.int64))
        if self.grammar is not None:    # the bitmask fills while the forward runs
            spec = self.spec
            self.grammar.start_fill(out, None if spec is None else spec.rows,
                                    None if spec is None else spec.first)
        ids = self.state.input_ids(meta.token_slots, meta.positions) if self.g.is_first else None
        return StepInputs(meta, ids)

    def run(self, meta: BatchMeta, **inputs):
        """The reference forward, or on the fast path a decode-only step through its CUDA graph
        (when one holds the rows) and any other step eagerly over the Triton kernels."""
        if self.fast is None:
            return self.stage(meta, **inputs)
        self.stage._check(meta, inputs.get("input_ids"), inputs.get("hidden"))
        if self.verify_in is not None:
            return self.verify_graphs.run(self.verify_in, **inputs)
        pm = PagedMeta.from_batch(meta, self.stage.cfg.num_kv_heads)
        if self.graphs is not None and meta.max_query_len == 1 and \
                self.graphs.bucket_for(meta.num_rows) is not None:
            return self.graphs.run(pm, **inputs)
        return self.fast.forward(pm, **inputs)
