"""The per-step work of one PP rank: the torch.distributed backend of :class:`ppstate.rank_step.RankStep`.

The order of a step (deferred consume -> free / admit -> inputs -> receive -> forward -> send ->
sample and publish, or post the deferred receive -> post-update -> validate) is
:class:`~ppstate.rank_step.RankStep`'s, shared with the simulator (docs/design.md, "The step of a
rank"). This module supplies the operations: device state, the forward (`step_forward.py`), p2p
hand-off of hidden states, sampling (`step_sampler.py`) and the sampled-token broadcast. The last
rank's sampled ids leave through a non-blocking copy to pinned memory: :meth:`StageRunner.launch`
returns before they land (:class:`~runtime.worker.pending_result.PendingResult`).

Every collective decision is a pure function of the replicated :class:`SchedulerOutput`
(``ppstate.pp_handler.need_sampled_mask``), so all ranks agree whether a broadcast happens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.events import NULL_SINK, EventSink
from ppstate.payload import SampledPayload
from ppstate.pp_handler import ConsumedEntry, PPHandler
from ppstate.rank_step import RankStep
from runtime.host_copy import HostCopy, to_device
from runtime.model.paged_stage import PagedStage
from runtime.model.stage import StageModel
from runtime.sampling.prompt_logprobs import PendingPrompt
from runtime.sampling.speculative_verify import SpecDecoder
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.device_state import DeviceState
from runtime.worker.grammar_hooks import GrammarHooks
from runtime.worker.groups import PPGroups
from runtime.worker.mirror_schedule import MirrorSchedule
from runtime.worker.pending_result import LogprobRows, PendingResult, sampled_fields
from runtime.worker.progress import Progress
from runtime.worker.step_forward import ForwardPath, StepInputs
from runtime.worker.step_sampler import StepSampler


class _PendingRecv:
    """Completion handle of a posted deferred receive of ``step``: ``wait()`` (called by the
    PPHandler on consume) is bounded by the group timeout; traced as the ``broadcast`` phase."""

    def __init__(self, runner: "StageRunner", step: int, work, buf: torch.Tensor) -> None:
        self.runner, self.step, self.work, self.buf = runner, step, work, buf
        # buf: [num_rows, width + 2] int64 (SampledPayload layout)

    def wait(self) -> None:
        r = self.runner
        ns0 = time.monotonic_ns()
        r.progress.enter("broadcast-wait")
        r.g.wait(self.work)
        r.progress.enter("prepare")
        if r.sink.enabled:
            r._emit_timing("broadcast", r.running_step, ns0)


@dataclass
class StepTiming:
    """Seconds this rank spent computing in one step (sent to the engine as ``ResultMsg.busy_s``).
    Time spent waiting on peers is not summed: the trace's ``recv`` / ``broadcast`` phase events
    carry it (``docs/trace_format.md``)."""
    busy_s: float = 0.0


class StageRunner:
    """Runs steps for one rank: a :class:`~ppstate.rank_step.RankBackend` over torch.distributed.

    Args:
        groups: process groups of this rank.
        stage: the rank's layers (``StageModel``).
        state: slot-indexed device state + mirrors.
        overlapped: bubble-free mode (PPHandler depth ``pp_size``) or sync mode (depth 1).
        validate_every: validate mirrors every N steps (0 = never); on CUDA asynchronously
            (:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`, at most one step late),
            scheduled by :attr:`mirrors` (:class:`~runtime.worker.mirror_schedule.MirrorSchedule`).
        sink: event sink (``rank.step``, PPHandler enqueue/consume/free, broadcast
            posted/skipped, sampled ids, mirror checks, phase timings; docs/trace_format.md).
        fast: GPU fast path over the same cache (Triton kernels), or None (the reference
            ``StageModel.forward``; always on the CPU).
        graphs: captured decode-only CUDA graphs of ``fast``, or None (eager).
        progress: where the rank reports its phase (read by its heartbeat; stall detection).
        spec: speculative decoding hooks (``--spec-tokens`` > 0), or None.
        grammar: structured-output hooks of the last rank
            (:class:`~runtime.worker.grammar_hooks.GrammarHooks`), or None.
        verify_graphs: captured speculative verify steps of ``fast``
            (:class:`~runtime.worker.verify_graphs.VerifyGraphs`), or None (eager).
        check_kernel: ``--mirror-check-kernel`` (``graph`` / ``fused``) of the CUDA mirror check.
    """

    def __init__(self, groups: PPGroups, stage: StageModel, state: DeviceState, overlapped: bool,
                 validate_every: int, sink: EventSink = NULL_SINK,
                 fast: PagedStage | None = None, graphs: DecodeGraphs | None = None,
                 progress: Progress | None = None, spec: SpecDecoder | None = None,
                 grammar: GrammarHooks | None = None, verify_graphs=None,
                 check_kernel: str = "graph") -> None:
        self.g, self.stage, self.state = groups, stage, state
        self.progress = progress if progress is not None else Progress(groups.rank, hook=None)
        self.fast, self.graphs = fast, graphs
        self.mirrors = MirrorSchedule(state, validate_every, sink, groups.rank, check_kernel,
                                      grammar)
        self.overlapped, self.sink = overlapped, sink
        self.device = state.device
        self.width = state.width
        self.hidden_size = stage.cfg.hidden_size
        self.act_dtype = next(stage.parameters()).dtype
        depth = groups.pp_size if overlapped else 1
        self.step_order = RankStep(self, groups.rank, groups.pp_size, depth, len(state.owner), sink,
                               phases=self.progress)
        self.host_copy = HostCopy(state.device)
        self._logprobs: LogprobRows | None = None   # of the step being sampled (last rank)
        self._prompt_lps: PendingPrompt | None = None        # its prompt logprobs (last rank)
        self._sampled: SampledPayload | None = None  # the payload this rank just sampled
        self.timing = StepTiming()
        self.running_step = -1   # the step being run (its consumes may be of skipped numbers)
        self.spec = spec
        self.grammar = grammar
        self.verify_graphs = verify_graphs
        self.fwd = ForwardPath(groups, stage, state, fast, graphs, spec, grammar, verify_graphs)
        self.sampler = StepSampler(state, self.fwd, spec, grammar)

    @property
    def handler(self) -> PPHandler | None:
        """The PPHandler of a non-last rank (None on the last rank)."""
        return self.step_order.handler

    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Run one step (:meth:`ppstate.rank_step.RankStep.step`). Returns the StepResult on the
        last rank, None elsewhere.

        Raises:
            MirrorDivergence: mirrors differ from device state after the step.
            RuntimeError: a peer did not answer within the group timeout.
        """
        pending = self.launch(out)
        result = None if pending is None else pending.result()
        self.run_deferred_check()
        return result

    def launch(self, out: SchedulerOutput) -> PendingResult | None:
        """Enqueue one step: on the last rank returns as soon as the step's kernels and the copy
        of its sampled ids to pinned host memory are enqueued (:meth:`PendingResult.result`
        waits for them); None on the other ranks. Raises as :meth:`step`."""
        return self.step_order.step(out)

    # ---- RankBackend: step bracket -----------------------------------------------------------
    def begin_step(self, out: SchedulerOutput) -> None:
        self.run_deferred_check()   # a caller that never ran it: before this step changes state
        self.timing = StepTiming()
        self.running_step = out.step

    def end_step(self, out: SchedulerOutput) -> None:
        self.mirrors.end_step(out.step)

    # ---- RankBackend: slot bookkeeping -------------------------------------------------------
    def free_and_admit(self, out: SchedulerOutput) -> None:
        for f in out.freed:
            self.state.free(f.slot)
        self.state.add_requests(out.new_requests)     # also their sampling parameters
        self.state.apply_block_updates(out.block_table_slots, out.block_table_cols,
                                       out.block_table_ids)
        self.mirrors.check_digests(out)
        if self.grammar is not None:
            self.grammar.admit(out)

    # ---- RankBackend: forward ----------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        return self.fwd.prepare(out)

    def receive(self, out: SchedulerOutput) -> torch.Tensor:
        ns_r = time.monotonic_ns()
        packed = self.g.recv_prev((2, out.total_tokens, self.hidden_size), self.act_dtype)
        if self.sink.enabled:
            self._emit_timing("recv", out.step, ns_r)
        return packed

    def forward(self, out: SchedulerOutput, inputs: StepInputs, received: torch.Tensor | None):
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        with torch.inference_mode():
            if received is None:
                res = self.fwd.run(inputs.meta, input_ids=inputs.input_ids)
            else:
                res = self.fwd.run(inputs.meta, hidden=received[0], residual=received[1])
        if self.sink.enabled:
            self._emit_timing("forward", out.step, ns0)
        self.timing.busy_s += time.perf_counter() - t0
        return res

    def send(self, out: SchedulerOutput, hidden) -> None:
        t0, ns_s = time.perf_counter(), time.monotonic_ns()
        with torch.inference_mode():
            self.g.send_next(torch.stack(hidden))
        if self.sink.enabled:
            self._emit_timing("send", out.step, ns_s)
        self.timing.busy_s += time.perf_counter() - t0

    def apply_scheduled(self, out: SchedulerOutput) -> None:
        meta = self.fwd.meta
        self.state.apply_scheduled(meta.slots, meta.query_lens, out.slots.astype(np.int64),
                                   out.num_scheduled_tokens.astype(np.int64))

    # ---- RankBackend: sampled tokens ---------------------------------------------------------
    def sample(self, out: SchedulerOutput, mask: np.ndarray | None,
               logits: torch.Tensor | None) -> SampledPayload:
        r, w = out.num_rows, self.width
        payload = SampledPayload(torch.zeros(SampledPayload.shape(r, w), dtype=torch.int64,
                                             device=self.device))
        self._logprobs, self._sampled, self._prompt_lps = None, payload, None
        if r == 0:
            return payload
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        self._logprobs, self._prompt_lps = self.sampler.run(out, mask, logits, payload)
        if self.sink.enabled:
            self._emit_timing("sample", out.step, ns0)
        self.timing.busy_s += time.perf_counter() - t0
        return payload

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        p = SampledPayload(payload.buf.to(self.device, non_blocking=True))
        idx = to_device(idx_mapping, self.device, torch.int64)
        plain = self.spec is None or (payload is self._sampled and not self.spec.rows.any_drafts)
        if plain:  # no drafts (none at all, or none in the step this last rank just sampled):
            # nothing is rejected, so no host read (a device sync) of the
            # payload's num_rejected column (zeros) on any rank, the last or a receiving one;
            # every applied row samples exactly one id
            rejected_np = np.zeros(len(idx_mapping), dtype=np.int64)
            sampled_np = np.ones(len(idx_mapping), dtype=np.int64)
        else:
            counts = p.buf[:, -2:].cpu().numpy()     # [num_rows, 2]: num_sampled, num_rejected
            sampled_np, rejected_np = counts[:, 0].copy(), counts[:, 1].copy()
        # the last rank's own ids reach the host anyway (its result copy): the token mirror
        # takes them from there (result) instead of copying them itself
        later = self.mirrors.defer_tokens(payload is self._sampled)
        self.state.apply_sampled(idx, p.token_ids, p.num_sampled, p.num_rejected,
                                 idx_mapping.astype(np.int64), rejected_np, sampled_np,
                                 tokens_later=later)

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                payload: SampledPayload) -> None:
        if self.g.pp_size == 1 or mask is None:
            return
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        work, buf = self.g.post_broadcast(payload.buf)
        self.g.keep_pending(work, buf)
        if self.sink.enabled:
            self._emit_timing("broadcast", out.step, ns0)
        self.timing.busy_s += time.perf_counter() - t0

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> _PendingRecv:
        buf = torch.empty(SampledPayload.shape(out.num_rows, self.width), dtype=torch.int64,
                          device=self.g.comm_device())
        return _PendingRecv(self, out.step, *self.g.post_broadcast(buf))

    def skip_receive(self, out: SchedulerOutput) -> None:
        return None

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        return SampledPayload(entry.handle.buf)

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> PendingResult:
        w = self.width
        if out.num_rows == 0:
            z = np.zeros(0, dtype=np.int32)
            return PendingResult.completed(
                StepResult(out.step, np.zeros((0, w), dtype=np.int64), z, z.copy()))
        # tracing: the mirror snapshot keeps its place in the trace, enqueued before the result
        # copy, whose event then covers it; else it runs after the result has left
        snap = self.mirrors.before_result(out.step)
        copy = self.host_copy.start(payload.buf)    # non_blocking into pinned memory + an event
        self.mirrors.after_result(copy, snap, w)
        return PendingResult(out.step, w, copy, self._logprobs, self.timing.busy_s,
                             self._prompt_lps)

    def sampled_ids(self, out: SchedulerOutput, payload: SampledPayload, result: PendingResult):
        # tracing: the ``sampled`` event keeps its place in the order; the sink holds it until
        # the copy to pinned memory landed (no wait here)
        return result.copy.ready, partial(sampled_fields, result.copy)

    # ---- mirrors and trace -------------------------------------------------------------------
    def run_deferred_check(self) -> None:
        """Start the CUDA mirror check of the step just run, if one waits
        (:meth:`MirrorSchedule.run_deferred_check`). The worker calls it once the step's result
        has been sent (or held back behind the next launch); :meth:`step` calls it after the
        result, and :meth:`begin_step` runs a forgotten one before the next step changes state.

        Raises:
            MirrorDivergence: from the comparison of an earlier snapshot.
        """
        self.mirrors.run_deferred_check()

    def _emit_timing(self, phase: str, step: int, ns0: int, ns1: int | None = None) -> None:
        self.sink.emit("timing", step=step, rank=self.g.rank, phase=phase, t0_ns=ns0,
                       t1_ns=time.monotonic_ns() if ns1 is None else ns1)

