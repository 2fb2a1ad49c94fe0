"""The per-step work of one PP rank: the torch.distributed backend of :class:`ppstate.rank_step.RankStep`.

The order of a step (deferred consume -> free / admit -> inputs -> receive -> forward -> send ->
sample and publish, or post the deferred receive -> post-update -> validate) is
:class:`~ppstate.rank_step.RankStep`'s, shared with the simulator (docs/design.md, "The step of a
rank"). This module supplies the operations: device state, the model forward, p2p hand-off of
hidden states, sampling and the sampled-token broadcast.

Every collective decision is a pure function of the replicated :class:`SchedulerOutput`
(``ppstate.pp_handler.need_sampled_mask``), so all ranks agree whether a broadcast happens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ppstate.batch import SchedulerOutput, StepResult
from ppstate.events import NULL_SINK, EventSink
from ppstate.payload import SampledPayload
from ppstate.pp_handler import ConsumedEntry, PPHandler
from ppstate.rank_step import RankStep
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.model.stage import BatchMeta, StageModel
from runtime.worker.sampler import SamplingBatch, TokenHistory, sample
from runtime.sampling_params import SamplingParams
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.device_state import DeviceState
from runtime.worker.groups import PPGroups
from runtime.worker.mirror_check import AsyncMirrorCheck


class _PendingRecv:
    """Completion handle of a posted deferred receive of ``step``: ``wait()`` (called by the
    PPHandler on consume) is bounded by the group timeout; traced as the ``broadcast`` phase."""

    def __init__(self, runner: "StageRunner", step: int, work, buf: torch.Tensor) -> None:
        self.runner, self.step, self.work, self.buf = runner, step, work, buf
        # buf: [num_rows, width + 2] int64 (SampledPayload layout)

    def wait(self) -> None:
        r = self.runner
        ns0 = time.monotonic_ns()
        r.g.wait(self.work)
        if r.sink.enabled:
            r._emit_timing("broadcast", self.step + r.handler.depth, ns0)


@dataclass
class StepTiming:
    """Seconds this rank spent computing in one step (sent to the engine as ``ResultMsg.busy_s``).
    Time spent waiting on peers is not summed: the trace's ``recv`` / ``broadcast`` phase events
    carry it (``docs/trace_format.md``)."""
    busy_s: float = 0.0


@dataclass
class _Inputs:
    """What :meth:`StageRunner.prepare_inputs` builds: the batch metadata and, on rank 0, the
    ``[num_tokens]`` input token ids gathered from device state."""
    meta: BatchMeta
    input_ids: torch.Tensor | None


class StageRunner:
    """Runs steps for one rank: a :class:`~ppstate.rank_step.RankBackend` over torch.distributed.

    Args:
        groups: process groups of this rank.
        stage: the rank's layers (``StageModel``).
        state: slot-indexed device state + mirrors.
        overlapped: bubble-free mode (PPHandler depth ``pp_size``) or sync mode (depth 1).
        validate_every: validate mirrors every N steps (0 = never); on CUDA asynchronously
            (:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`, at most one step late).
        sink: event sink (``rank.step``, PPHandler enqueue/consume/free, broadcast
            posted/skipped, sampled ids, mirror checks, phase timings; docs/trace_format.md).
        fast: GPU fast path over the same cache (Triton kernels), or None (the reference
            ``StageModel.forward``; always on the CPU).
        graphs: captured decode-only CUDA graphs of ``fast``, or None (eager).
    """

    def __init__(self, groups: PPGroups, stage: StageModel, state: DeviceState, overlapped: bool,
                 validate_every: int, sink: EventSink = NULL_SINK,
                 fast: PagedStage | None = None, graphs: DecodeGraphs | None = None) -> None:
        self.g, self.stage, self.state = groups, stage, state
        self.fast, self.graphs = fast, graphs
        self.mirror_check = AsyncMirrorCheck(state) if state.device.type == "cuda" else None
        self.overlapped, self.validate_every, self.sink = overlapped, validate_every, sink
        self.device = state.device
        self.width = state.width
        self.hidden_size = stage.cfg.hidden_size
        self.act_dtype = next(stage.parameters()).dtype
        depth = groups.pp_size if overlapped else 1
        self._order = RankStep(self, groups.rank, groups.pp_size, depth, len(state.owner), sink)
        self._params: dict[int, SamplingParams] = {}
        self._logprobs = None       # per-row logprobs of the step being sampled (last rank)
        self.timing = StepTiming()

    @property
    def handler(self) -> PPHandler | None:
        """The PPHandler of a non-last rank (None on the last rank)."""
        return self._order.handler

    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Run one step (:meth:`ppstate.rank_step.RankStep.step`). Returns the StepResult on the
        last rank, None elsewhere.

        Raises:
            MirrorDivergence: mirrors differ from device state after the step.
            RuntimeError: a peer did not answer within the group timeout.
        """
        return self._order.step(out)

    # ---- RankBackend: step bracket -----------------------------------------------------------
    def begin_step(self, out: SchedulerOutput) -> None:
        self.timing = StepTiming()
        if self.sink.enabled:
            self.sink.emit("rank.step", step=out.step, rank=self.g.rank, num_rows=out.num_rows)

    def end_step(self, out: SchedulerOutput) -> None:
        if self.validate_every and out.step % self.validate_every == 0:
            if self.mirror_check is not None:
                self.mirror_check.snapshot(out.step)   # compared when its copy lands
            else:
                self._validate(out.step)
        elif self.mirror_check is not None:
            self.mirror_check.poll()

    # ---- RankBackend: slot bookkeeping -------------------------------------------------------
    def free_and_admit(self, out: SchedulerOutput) -> None:
        for f in out.freed:
            self.state.free(f.slot)
            self._params.pop(f.slot, None)
        self.state.add_requests(out.new_requests)
        self.state.apply_block_updates(out.block_table_slots, out.block_table_cols,
                                       out.block_table_ids)
        if self.g.is_last:
            for r in out.new_requests:
                self._params[r.slot] = SamplingParams(**r.sampling)

    # ---- RankBackend: forward ----------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> _Inputs:
        meta = BatchMeta.build(out.slots, out.start_positions, out.num_scheduled_tokens,
                               self.device, torch.from_numpy(self.state.block_table_np),
                               self.state.block_size, attention_groups=self.fast is None)
        ids = self.state.input_ids(meta.token_slots, meta.positions) if self.g.is_first else None
        return _Inputs(meta, ids)

    def receive(self, out: SchedulerOutput) -> torch.Tensor:
        ns_r = time.monotonic_ns()
        packed = self.g.recv_prev((2, out.total_tokens, self.hidden_size), self.act_dtype)
        if self.sink.enabled:
            self._emit_timing("recv", out.step, ns_r)
        return packed

    def forward(self, out: SchedulerOutput, inputs: _Inputs, received: torch.Tensor | None):
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        with torch.inference_mode():
            if received is None:
                res = self._stage_forward(inputs.meta, input_ids=inputs.input_ids)
            else:
                res = self._stage_forward(inputs.meta, hidden=received[0], residual=received[1])
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
        dev = self.device
        slots = torch.as_tensor(out.slots, dtype=torch.int64, device=dev)
        num_scheduled_tokens = torch.as_tensor(out.num_scheduled_tokens, dtype=torch.int64,
                                               device=dev)
        self.state.apply_scheduled(slots, num_scheduled_tokens, out.slots.astype(np.int64),
                                   out.num_scheduled_tokens.astype(np.int64))

    def _stage_forward(self, meta: BatchMeta, **inputs):
        """The reference forward, or on the fast path a decode-only step through its CUDA graph
        (when one holds the rows) and any other step eagerly over the Triton kernels."""
        if self.fast is None:
            return self.stage(meta, **inputs)
        self.stage._check(meta, inputs.get("input_ids"), inputs.get("hidden"))
        pm = PagedMeta.from_batch(meta, self.stage.cfg.num_kv_heads)
        if self.graphs is not None and meta.max_query_len == 1 and \
                self.graphs.bucket_for(meta.num_rows) is not None:
            return self.graphs.run(pm, **inputs)
        return self.fast.forward(pm, **inputs)

    # ---- RankBackend: sampled tokens ---------------------------------------------------------
    def sample(self, out: SchedulerOutput, mask: np.ndarray | None,
               logits: torch.Tensor | None) -> SampledPayload:
        r, w = out.num_rows, self.width
        payload = SampledPayload(torch.zeros(SampledPayload.shape(r, w), dtype=torch.int64,
                                             device=self.device))
        self._logprobs = None
        if r == 0:
            return payload
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        if mask is not None:
            rows = np.nonzero(mask)[0]
            params = [self._params[int(out.slots[i])] for i in rows]
            s = out.slots[rows]
            prompt = self.state.mirror.prefill_len_np[s] - self.state.output_offset_np[s]
            out_idx = (out.start_positions[rows] + out.num_scheduled_tokens[rows] - prompt).tolist()
            batch = SamplingBatch.build(params, out_idx, self.device)
            rows_t = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
            history = None
            if batch.penalty_rows is not None:  # penalties read the slots' token history
                slots_t = torch.as_tensor(out.slots[rows], dtype=torch.int64, device=self.device)
                history = TokenHistory.gather(self.state.all_token_ids, self.state.prefill_len,
                                              self.state.total_len, slots_t[batch.penalty_rows])
            so = sample(logits.index_select(0, rows_t).float(), batch, history)
            payload.token_ids[rows_t, 0] = so.token_ids
            payload.num_sampled[rows_t] = 1
            self._logprobs = _logprob_rows(so, rows, r, params)
        if self.sink.enabled:
            self._emit_timing("sample", out.step, ns0)
        self.timing.busy_s += time.perf_counter() - t0
        return payload

    def apply_sampled(self, step: int, idx_mapping: np.ndarray, payload: SampledPayload) -> None:
        p = SampledPayload(payload.buf.to(self.device))
        idx = torch.as_tensor(idx_mapping, dtype=torch.int64, device=self.device)
        rejected_np = p.num_rejected.cpu().numpy()
        self.state.apply_sampled(idx, p.token_ids, p.num_sampled, p.num_rejected,
                                 idx_mapping.astype(np.int64), rejected_np)

    def publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                payload: SampledPayload) -> None:
        if self.g.pp_size == 1:
            return
        if mask is None:
            if self.sink.enabled:
                self.sink.emit("broadcast.skipped", step=out.step, rank=self.g.rank)
            return
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        work, buf = self.g.post_broadcast(payload.buf)
        self.g.keep_pending(work, buf)
        if self.sink.enabled:
            self._emit_timing("broadcast", out.step, ns0)
            self.sink.emit("broadcast.posted", step=out.step, rank=self.g.rank,
                           rows=int(mask.sum()))
        self.timing.busy_s += time.perf_counter() - t0

    def post_receive(self, out: SchedulerOutput, mask: np.ndarray) -> _PendingRecv:
        buf = torch.empty(SampledPayload.shape(out.num_rows, self.width), dtype=torch.int64,
                          device=self.g.comm_device())
        pending = _PendingRecv(self, out.step, *self.g.post_broadcast(buf))
        if self.sink.enabled:
            self.sink.emit("broadcast.posted", step=out.step, rank=self.g.rank,
                           rows=int(mask.sum()))
        return pending

    def skip_receive(self, out: SchedulerOutput) -> None:
        if self.sink.enabled:
            self.sink.emit("broadcast.skipped", step=out.step, rank=self.g.rank)

    def received(self, entry: ConsumedEntry) -> SampledPayload:
        return SampledPayload(entry.handle.buf)

    def result(self, out: SchedulerOutput, payload: SampledPayload) -> StepResult:
        if out.num_rows == 0:
            z = np.zeros(0, dtype=np.int32)
            return StepResult(out.step, np.zeros((0, self.width), dtype=np.int64), z, z.copy())
        host = SampledPayload(payload.buf.cpu().numpy())
        if self.sink.enabled:
            self.sink.emit("sampled", step=out.step, rank=self.g.rank, req_ids=list(out.req_ids),
                           token_ids=host.token_ids.tolist(), num_sampled=host.num_sampled.tolist())
        return StepResult(out.step, host.token_ids.copy(), host.num_sampled.astype(np.int32),
                          host.num_rejected.astype(np.int32), self._logprobs)

    # ---- mirrors and trace -------------------------------------------------------------------
    def _validate(self, step: int) -> None:
        """Mirror validation (invariant 4), recorded as ``mirror.check`` when tracing."""
        if not self.sink.enabled:
            self.state.validate(step)
            return
        live = self.state.live_slots()
        values = self.state.mirror.num_computed_tokens_np[live].tolist()
        try:
            self.state.validate(step)
        except Exception as exc:
            self.sink.emit("mirror.check", step=step, rank=self.g.rank, slots=live.tolist(),
                           num_computed_tokens=values, ok=False, message=str(exc))
            raise
        self.sink.emit("mirror.check", step=step, rank=self.g.rank, slots=live.tolist(),
                       num_computed_tokens=values, ok=True, message=None)

    def _emit_timing(self, phase: str, step: int, ns0: int, ns1: int | None = None) -> None:
        self.sink.emit("timing", step=step, rank=self.g.rank, phase=phase, t0_ns=ns0,
                       t1_ns=time.monotonic_ns() if ns1 is None else ns1)


def _logprob_rows(so, rows: np.ndarray, num_rows: int, params: list[SamplingParams]):
    """Per-row logprob payload ``[num_rows]`` (None for rows without a request for logprobs)."""
    if so.logprobs is None or not any(p.logprobs is not None for p in params):
        return None
    lp = so.logprobs.float().cpu().tolist()
    top = None
    if so.top_logprobs is not None:
        top = (so.top_logprobs[0].cpu().tolist(), so.top_logprobs[1].float().cpu().tolist())
    outs: list = [None] * num_rows
    for j, i in enumerate(rows):
        k = params[j].logprobs
        if k is None:
            continue
        alts = {} if top is None else dict(zip(top[0][j][:k], top[1][j][:k]))
        outs[int(i)] = (lp[j], alts)
    return outs
