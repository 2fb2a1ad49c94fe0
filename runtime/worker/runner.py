"""The per-step work of one PP rank (docs/design.md §5).

Order inside a step: consume the deferred entry (non-last ranks, overlapped mode) -> free / admit
slots -> prepare inputs from device state -> receive hidden states from rank - 1 -> forward ->
send to rank + 1 -> last rank: sample, post-update, broadcast on the sibling group; other ranks:
post the deferred receive -> immediate post-update (+query length) -> validate CPU mirrors.

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
from ppstate.pp_handler import PPHandler, need_sampled_mask
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.model.stage import BatchMeta, StageModel
from runtime.sampler import SamplingBatch, TokenHistory, sample
from runtime.sampling_params import SamplingParams
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.device_state import DeviceState
from runtime.worker.groups import PPGroups
from runtime.worker.mirror_check import AsyncMirrorCheck
from runtime.worker.spec_verify import SpecDecoder, logprob_rows as spec_logprob_rows


class _PendingRecv:
    """Completion handle of a posted deferred receive: ``wait()`` bounded by the group timeout."""

    def __init__(self, groups: PPGroups, work, buf: torch.Tensor) -> None:
        self.groups, self.work, self.buf = groups, work, buf  # buf: [num_rows, width + 2] int64

    def wait(self) -> None:
        self.groups.wait(self.work)


@dataclass
class StepTiming:
    """Seconds this rank spent computing (busy) and waiting on peers in one step."""
    busy_s: float = 0.0
    wait_s: float = 0.0


class StageRunner:
    """Runs steps for one rank.

    Args:
        groups: process groups of this rank.
        stage: the rank's layers (``StageModel``).
        state: slot-indexed device state + mirrors.
        overlapped: bubble-free mode (deferred consume) or sync mode (blocking broadcast).
        validate_every: validate mirrors every N steps (0 = never); on CUDA asynchronously
            (:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`, at most one step late).
        sink: event sink (``rank.step``, PPHandler enqueue/consume/free, broadcast
            posted/skipped, sampled ids, mirror checks, phase timings; docs/trace_format.md).
        fast: GPU fast path over the same cache (Triton kernels), or None (the reference
            ``StageModel.forward``; always on the CPU).
        graphs: captured decode-only CUDA graphs of ``fast``, or None (eager).
        spec: speculative decoding hooks (``--spec-tokens`` > 0), or None.
    """

    def __init__(self, groups: PPGroups, stage: StageModel, state: DeviceState, overlapped: bool,
                 validate_every: int, sink: EventSink = NULL_SINK,
                 fast: PagedStage | None = None, graphs: DecodeGraphs | None = None,
                 spec: SpecDecoder | None = None) -> None:
        self.g, self.stage, self.state = groups, stage, state
        self.fast, self.graphs = fast, graphs
        self.mirror_check = AsyncMirrorCheck(state) if state.device.type == "cuda" else None
        self.overlapped, self.validate_every, self.sink = overlapped, validate_every, sink
        self.device = state.device
        self.width = state.width
        self.hidden_size = stage.cfg.hidden_size
        self.act_dtype = next(stage.parameters()).dtype
        self.handler: PPHandler | None = None
        if overlapped and groups.pp_size > 1 and not groups.is_last:
            self.handler = PPHandler(groups.pp_size, len(state.owner), sink=sink, rank=groups.rank)
        self._params: dict[int, SamplingParams] = {}
        self.timing = StepTiming()
        self.spec = spec

    # ---- slot bookkeeping -------------------------------------------------------------------
    def _apply_freed_new(self, out: SchedulerOutput) -> None:
        for f in out.freed:
            self.state.free(f.slot)
            self._params.pop(f.slot, None)
            if self.handler is not None:
                self.handler.on_slot_freed(f.slot, out.step)
        self.state.add_requests(out.new_requests)
        self.state.apply_block_updates(out.block_table_slots, out.block_table_cols,
                                       out.block_table_ids)
        if self.g.is_last:
            for r in out.new_requests:
                self._params[r.slot] = SamplingParams(**r.sampling)

    # ---- deferred consume (non-last ranks) ---------------------------------------------------
    def _consume(self) -> None:
        if self.handler is None:
            return
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        entry = self.handler.consume()  # waits on the pending receive, if any
        self.timing.wait_s += time.perf_counter() - t0
        if self.sink.enabled and entry is not None:
            self._emit_timing("broadcast", entry.step + self.handler.depth, ns0)
        if entry is not None:
            self._apply_buffer(entry.handle.buf, entry.idx_mapping)

    def _apply_buffer(self, buf: torch.Tensor, idx_mapping_np: np.ndarray) -> None:
        buf = buf.to(self.device)
        w = self.width
        idx = torch.as_tensor(idx_mapping_np, dtype=torch.int64, device=self.device)
        rejected_np = buf[:, w + 1].cpu().numpy()
        self.state.apply_sampled(idx, buf[:, :w], buf[:, w], buf[:, w + 1],
                                 idx_mapping_np.astype(np.int64), rejected_np)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Run one step. Returns the StepResult on the last rank, None elsewhere.

        Raises:
            MirrorDivergence: mirrors differ from device state after the step.
            RuntimeError: a peer did not answer within the group timeout.
        """
        self.timing = StepTiming()
        if self.sink.enabled:
            self.sink.emit("rank.step", step=out.step, rank=self.g.rank, num_rows=out.num_rows)
        self._consume()
        self._apply_freed_new(out)
        mask = need_sampled_mask(out)
        result = None
        if out.is_empty:
            if self.handler is not None:
                self.handler.enqueue(out.step, out, None, None)
            if self.sink.enabled and self.g.pp_size > 1:
                self.sink.emit("broadcast.skipped", step=out.step, rank=self.g.rank)
            result = self._empty_result(out) if self.g.is_last else None
        else:
            result = self._run_rows(out, mask)
        if self.validate_every and out.step % self.validate_every == 0:
            if self.mirror_check is not None:
                self.mirror_check.snapshot(out.step)   # compared when its copy lands
            else:
                self._validate(out.step)
        elif self.mirror_check is not None:
            self.mirror_check.poll()
        return result

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

    def _run_rows(self, out: SchedulerOutput, mask: np.ndarray | None) -> StepResult | None:
        dev = self.device
        slots = torch.as_tensor(out.slots, dtype=torch.int64, device=dev)
        qlens = torch.as_tensor(out.num_scheduled_tokens, dtype=torch.int64, device=dev)
        starts_np = out.start_positions
        if self.spec is not None:  # speculative decoding (#14): own corrected starts, drafts
            starts_np = self.spec.prepare(out, self.state)
        meta = BatchMeta.build(out.slots, starts_np, out.num_scheduled_tokens, dev,
                               torch.from_numpy(self.state.block_table_np), self.state.block_size,
                               attention_groups=self.fast is None)
        if self.spec is not None and self.g.is_last:
            meta = self.spec.logit_meta(meta, out)
        hidden = self._forward(out, meta)
        self.state.apply_scheduled(slots, qlens, out.slots.astype(np.int64),
                                   out.num_scheduled_tokens.astype(np.int64))
        if self.g.is_last:
            return self._sample_and_publish(out, mask, hidden)
        self._post_receive(out, mask)
        return None

    def _forward(self, out: SchedulerOutput, meta: BatchMeta) -> torch.Tensor:
        t_total = out.total_tokens
        trace, step = self.sink.enabled, out.step
        with torch.inference_mode():
            if self.g.is_first:
                ids = self.state.input_ids(meta.token_slots, meta.positions)
                t0, ns0 = time.perf_counter(), time.monotonic_ns()
                res = self._stage_forward(meta, input_ids=ids)
            else:
                t0, ns_r = time.perf_counter(), time.monotonic_ns()
                packed = self.g.recv_prev((2, t_total, self.hidden_size), self.act_dtype)
                t1, ns0 = time.perf_counter(), time.monotonic_ns()
                if trace:
                    self._emit_timing("recv", step, ns_r, ns0)
                self.timing.wait_s += t1 - t0
                t0 = t1
                res = self._stage_forward(meta, hidden=packed[0], residual=packed[1])
            if trace:
                self._emit_timing("forward", step, ns0)
            if not self.g.is_last:
                ns_s = time.monotonic_ns()
                self.g.send_next(torch.stack(res))
                if trace:
                    self._emit_timing("send", step, ns_s)
        self.timing.busy_s += time.perf_counter() - t0
        return res

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

    def _post_receive(self, out: SchedulerOutput, mask: np.ndarray | None) -> None:
        if mask is None:
            if self.handler is not None:
                self.handler.enqueue(out.step, out, None, None)
            if self.sink.enabled:
                self.sink.emit("broadcast.skipped", step=out.step, rank=self.g.rank)
            return
        buf = torch.empty((out.num_rows, self.width + 2), dtype=torch.int64,
                          device=self.g.comm_device())
        if self.handler is not None:
            pending = _PendingRecv(self.g, *self.g.post_broadcast(buf))
            self.handler.enqueue(out.step, out, mask, pending)
            if self.sink.enabled:
                self.sink.emit("broadcast.posted", step=out.step, rank=self.g.rank,
                               rows=int(mask.sum()))
        else:  # sync mode: blocking broadcast on the PP group, immediate consume
            t0, ns0 = time.perf_counter(), time.monotonic_ns()
            got = self.g.blocking_broadcast(buf)
            self.timing.wait_s += time.perf_counter() - t0
            if self.sink.enabled:
                self._emit_timing("broadcast", out.step, ns0)
                self.sink.emit("broadcast.posted", step=out.step, rank=self.g.rank,
                               rows=int(mask.sum()))
            idx = np.where(mask, out.slots, -1).astype(np.int64)
            self._apply_buffer(got, idx)

    def _sample_and_publish(self, out: SchedulerOutput, mask: np.ndarray | None,
                            logits: torch.Tensor) -> StepResult:
        t0, ns0 = time.perf_counter(), time.monotonic_ns()
        r, w = out.num_rows, self.width
        payload = torch.zeros((r, w + 2), dtype=torch.int64, device=self.device)
        logprobs = None
        if mask is not None and self.spec is not None:  # speculative decoding (#14)
            params = [self._params[int(out.slots[i])] for i in np.nonzero(mask)[0]]
            v, rows = self.spec.sample(out, mask, logits, params, self.state, payload)
            logprobs = spec_logprob_rows(v, rows, r, params)
        elif mask is not None:
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
            payload[rows_t, 0] = so.token_ids
            payload[rows_t, w] = 1
            logprobs = _logprob_rows(so, rows, r, params)
        idx_np = np.where(mask if mask is not None else False, out.slots, -1).astype(np.int64)
        idx = torch.as_tensor(idx_np, device=self.device)
        self.state.apply_sampled(idx, payload[:, :w], payload[:, w], payload[:, w + 1],
                                 idx_np, payload[:, w + 1].cpu().numpy())
        if self.sink.enabled:
            self._emit_timing("sample", out.step, ns0)
        if self.g.pp_size > 1:
            self._publish(out, mask, payload)
        self.timing.busy_s += time.perf_counter() - t0
        host = payload.cpu().numpy()
        if self.sink.enabled:
            self.sink.emit("sampled", step=out.step, rank=self.g.rank, req_ids=list(out.req_ids),
                           token_ids=host[:, :w].tolist(), num_sampled=host[:, w].tolist())
        return StepResult(out.step, host[:, :w].copy(), host[:, w].astype(np.int32),
                          host[:, w + 1].astype(np.int32), logprobs)

    def _publish(self, out: SchedulerOutput, mask: np.ndarray | None, payload: torch.Tensor) -> None:
        if mask is None:
            if self.sink.enabled:
                self.sink.emit("broadcast.skipped", step=out.step, rank=self.g.rank)
            return
        ns0 = time.monotonic_ns()
        if self.overlapped:
            work, buf = self.g.post_broadcast(payload)
            self.g.keep_pending(work, buf)
        else:
            self.g.blocking_broadcast(payload)
        if self.sink.enabled:
            self._emit_timing("broadcast", out.step, ns0)
            self.sink.emit("broadcast.posted", step=out.step, rank=self.g.rank,
                           rows=int(mask.sum()))

    def _empty_result(self, out: SchedulerOutput) -> StepResult:
        z = np.zeros(0, dtype=np.int32)
        return StepResult(out.step, np.zeros((0, self.width), dtype=np.int64), z, z.copy())


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
