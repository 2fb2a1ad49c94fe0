"""Mirror validation off the critical path, compared on the device (invariant 4 every step, no
host sync and no host comparison).

After a step, :meth:`AsyncMirrorCheck.snapshot` writes the host copies of everything checked
(:mod:`runtime.worker.state_check`: the mirrored counters, ``total_len``, the block-table columns,
the sampling tables, the biased live slots' logit-bias rows) as they are at that moment, with the
live-slot mask and the scheduler's block-id digests of the step's rows (:meth:`expect_digests`),
into pinned host memory, and enqueues the device work of :mod:`runtime.worker.check_graph` in
stream order after the step: one copy of those expected values to the device, the step's
snapshot of the device tables, and one flag (the snapshot against the expected values, the block
counts against ``ceil(num_computed_tokens / block_size)``, the device table's digests against the
scheduler's) copied back as one byte, with the token rows' digests
(:mod:`runtime.worker.token_check`).

The comparison of the common path is therefore one byte read when the copies have landed
(:meth:`poll` checks it opportunistically; the next :meth:`snapshot` forces it), so a divergence
is still reported at the latest while the next step finishes ("within one step"). Without
logit-bias rows the device work is one CUDA graph per buffer, and the host copies live in one
array laid out as the graph's input (``DeviceState.host_flat``): per step the host makes one
array copy and four small writes (the live mask, the step rows' digests), one graph launch, one
event record (none on the last rank, below) and, for the previous step, one byte read and one
comparison of the token digests. Only when the flag is set does
:func:`~runtime.worker.mirror_naming.name_divergence` copy the step's snapshot (kept on the
device, double-buffered) back and look field by field over the live slots, then at the block
counts and the digests, to raise :class:`~ppstate.errors.MirrorDivergence` naming rank, step,
slot, request, field and both values, as the synchronous check does.

The rank takes the snapshot once the step's result has left the worker
(:meth:`~runtime.worker.runner.StageRunner.run_deferred_check`), so none of this host work sits
between a step's launch and the engine receiving its result. On the last rank the token mirror
takes the sampled ids from the result copy's host buffer (``TokenMirror.record(later=True)`` /
``attach``) instead of copying them itself. When tracing, the last rank's snapshot instead rides
on the step's result copy, where the trace records it: ``snapshot(step, later=True)`` enqueues the
check's device work just before that copy and records no event, and :meth:`share` hands over the
copy's :class:`~runtime.host_copy.PendingCopy` (its event completes after the check's copies).
``python -m runtime.bench mirror`` measures the check's host work against an older revision of
this module read from git.

On the CPU (no events) every operation runs at once and the comparison is immediate.

When tracing, each snapshot records its ``mirror.check`` event at the place the synchronous check
would (``JsonlSink.emit_when``: the sink holds it, and the rank's later events, until the
comparison has run), with the verdict of that comparison, so a GPU run's trace replays like a
CPU run's (docs/trace_format.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ppstate.errors import MirrorDivergence
from ppstate.events import NULL_SINK, EventSink
from runtime.worker import state_check
from runtime.worker.check_graph import CheckGraph
from runtime.worker.mirror_naming import name_divergence


def m_slots(state) -> int:
    """Slots of ``state`` (``max_num_reqs``)."""
    return state.block_table_np.shape[0]


@dataclass(slots=True)
class _Pending:
    step: int
    buf: int                       # index of the double-buffered host / device arrays in use
    live: np.ndarray               # [num_live] slots compared
    owners: tuple                  # [max_num_reqs] req ids at snapshot time
    event: object | None
    cols: int = 1                  # block-table columns in the flat layout
    biased: np.ndarray | None = None   # [B] biased live slots whose logit-bias rows follow
    size: int = 0                  # int32 words of the flat layout
    tag: int = -1                  # TokenMirror tag: its writes recorded before this snapshot
    verdict: tuple[bool, str | None] | None = None   # (ok, message) once compared
    copy: object | None = None     # a PendingCopy whose event stands for this snapshot's (share)
    awaiting: bool = False         # snapshot(later=True) before its share()

    def landed(self) -> bool:
        """Whether the snapshot's copies have landed (never blocks)."""
        if self.awaiting:
            return False
        if self.copy is not None:
            return self.copy.ready()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block until the snapshot's copies have landed."""
        if self.copy is not None:
            self.copy.wait()
        elif self.event is not None:
            self.event.synchronize()


class AsyncMirrorCheck:
    """Double-buffered snapshots of one rank's device state, compared on the device.

    Args:
        state: the rank's DeviceState (device tensors ``[max_num_reqs]`` int64, ``mirror``,
            ``owner``, ``live_slots()``, ``block_size``, ``host_flat``).
        sink: where ``mirror.check`` events go when it is enabled (tracing); rank: their rank.
        kernel: how the device sets the flag, ``"graph"`` (torch kernels) or ``"fused"`` (one
            Triton kernel); ``--mirror-check-kernel``, :class:`~runtime.worker.check_graph.CheckGraph`.
    """

    def __init__(self, state, sink: EventSink = NULL_SINK, rank: int | None = None,
                 kernel: str = "graph") -> None:
        self.state, self.sink, self.rank = state, sink, rank
        self._pin = state.device.type == "cuda"
        self.dev = CheckGraph(state, kernel)   # buffers and device work
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self._pin else None
        self.pending: list[_Pending] = []
        self._error: MirrorDivergence | None = None   # found while recording, raised next
        self._unshared: _Pending | None = None   # a snapshot(later=True) waiting for share()
        self._digests: tuple | None = None   # (step, slots, block_digests) of expect_digests
        self.checked_steps = 0
        self._graphed_tokens = None   # the TokenMirror whose digests the graphs compute
        self._graph_size = state_check.flat_size(m_slots(state), self.dev.cols)   # graph layout
        # state.live_version -> its live slots [num_live] and owners [max_num_reqs] (read-only)
        self._live: tuple[int, np.ndarray, tuple] = (-1, None, ())
        self._no_bias = np.zeros(0, dtype=np.intp)   # [0] biased slots
        self._aux_of = None                 # the CheckGraph.exp_np the records below describe
        self._graph_expected: list = []     # per buffer: its [graph size] expected-values view
        self._aux_live = [-1, -1]           # per buffer: the live_version of its live-mask row
        self._aux_rows: list = [None, None]   # per buffer: (dtype, bytes) of its step-row slots

    def _live_slots(self) -> tuple[np.ndarray, tuple]:
        """``([num_live] live slots, [max_num_reqs] owners)`` now, recomputed only when the
        state's ``live_version`` changed (admission, free): a decode step reuses them."""
        st = self.state
        if self._live[0] != st.live_version:
            self._live = (st.live_version, st.live_slots(), tuple(st.owner))
        return self._live[1], self._live[2]

    @property
    def use_graphs(self) -> bool:
        """Whether the device work runs as captured CUDA graphs (off: op by op)."""
        return self.dev.use_graphs

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self.dev.use_graphs = on

    def expect_digests(self, out) -> None:
        """The scheduler's block-id digests of step ``out.step``'s rows
        (:attr:`~ppstate.batch.SchedulerOutput.block_digests`, None: none to compare), checked
        on the device against the rank's table by that step's snapshot (instead of
        ``DeviceState.check_block_digests`` on the host before the forward)."""
        self._digests = (out.step, out.slots, out.block_digests)

    def _write_aux(self, k: int, step: int) -> None:
        """Buffer ``k``'s int64 rows: the live mask and the step rows' mask and expected digests.
        The buffer keeps what it held two steps ago, so the masks are written only when they
        changed since then (the live mask: ``live_version``; the step rows: their slots), the
        digests of the step's rows always (a few ``[R]`` calls on a decode step)."""
        live, rows, digests = self.dev.aux_rows[k]   # [n] int64 each (views)
        st = self.state
        if self._aux_live[k] != st.live_version:
            np.copyto(live, st.live_np)
            self._aux_live[k] = st.live_version
        d, self._digests = self._digests, None
        if d is not None and d[0] == step and d[2] is not None and len(d[1]):
            slots = d[1]
            key = (slots.dtype.char, slots.tobytes())
            if key != self._aux_rows[k]:
                rows.fill(0)
                rows.put(slots, 1)
                self._aux_rows[k] = key
            digests.put(slots, d[2])   # put: the cheapest scatter
        elif self._aux_rows[k] != ():
            rows.fill(0)
            self._aux_rows[k] = ()

    def snapshot(self, step: int, later: bool = False) -> None:
        """Start the check of ``step`` (call after the step's post-update was issued). Finishes
        the previous step's check first (blocking on its flag if still in flight).

        Args:
            later: CUDA only: record no event; the caller enqueues a device-to-host copy right
                after and hands its :class:`~runtime.host_copy.PendingCopy` to :meth:`share`
                before the next snapshot or poll (the last rank when tracing: the step's result
                copy, whose event then covers the check's copies too, and whose wait the engine
                makes anyway).

        Raises:
            MirrorDivergence: from the previous step's (or, on CPU, this step's) comparison.
        """
        self.poll(block=True)
        st = self.state
        live, owners = self._live_slots()
        if live.size == 0:
            if self.sink.enabled:   # nothing to compare, recorded as the synchronous check does
                self.sink.emit("mirror.check", step=step, rank=self.rank, slots=[],
                               num_computed_tokens=[], ok=True, message=None)
            return
        k = step % 2
        no_bias = st.sampling_state.logit_bias.ids is None   # no bias seen yet: no rows
        bl = self._no_bias if no_bias else state_check.biased(st, live)
        dev = self.dev
        if st.tokens is not self._graphed_tokens:   # token check switched on / off: recapture
            dev.graphs, self._graphed_tokens = None, st.tokens
        graph = dev.graph(k) if dev.use_graphs and not bl.size else None
        if graph is not None:   # every column, no logit-bias rows: the buffers hold it
            cols, size = dev.cols, self._graph_size
        else:
            cols = state_check.used_cols(st, live)
            size = state_check.flat_size(m_slots(st), cols, bl.size, state_check.bias_width(st))
            dev.grow(size)
        if self._aux_of is not dev.exp_np:   # new buffers (first step, grow): nothing written
            self._aux_of, self._aux_live, self._aux_rows = dev.exp_np, [-1, -1], [None, None]
            self._graph_expected = [dev.expected(b, self._graph_size) for b in range(2)]
        self._write_aux(k, step)
        if graph is not None:   # the host copies live in the graph's layout: one copy
            np.copyto(self._graph_expected[k], st.host_flat)
            graph.replay()
        else:
            state_check.host_flat(st, cols, dev.expected(k, size), bl)
            dev.enqueue(k, size, cols, bl)
        event = None
        if self._pin and not later:   # buffer k's previous snapshot was compared (poll above)
            event = self._events[k]
            event.record()
        p = _Pending(step, k, live, owners, event, cols, bl, size,
                     awaiting=self._pin and later)
        self._unshared = p if p.awaiting else None
        if st.tokens is not None:
            p.tag, st.tokens.tag = st.tokens.tag, st.tokens.tag + 1
        self.pending.append(p)
        if self.sink.enabled:
            values = st.mirror.num_computed_tokens_np[live].tolist()
            self.sink.emit_when(lambda: p.verdict is not None or p.landed(),
                                "mirror.check", step, self.rank,
                                lambda: self._check_fields(p, values))
        if not self._pin:
            self.poll(block=True)

    def share(self, copy) -> None:
        """The copy (:class:`~runtime.host_copy.PendingCopy`) enqueued right after a
        ``snapshot(..., later=True)``: its landing stands for the snapshot's. No-op when no
        snapshot waits for one (none was taken: no live slot, or on the CPU)."""
        p, self._unshared = self._unshared, None
        if p is not None:
            p.copy, p.awaiting = copy, False

    def _check_fields(self, p: _Pending, values: list[int]) -> dict:
        """The ``mirror.check`` event's fields of ``p``, compared now if its copy landed but no poll
        ran yet (a divergence found here is recorded and raised by the snapshot or poll that
        follows, as the check's own order has it: the comparisons run in snapshot order)."""
        if p.verdict is None:
            try:
                self.poll(until=p)
            except MirrorDivergence as exc:   # raised by the next snapshot / poll, not here
                self._error = exc
        ok, message = p.verdict if p.verdict is not None else (True, None)
        return {"slots": p.live.tolist(), "num_computed_tokens": values, "ok": ok,
                "message": message}

    def poll(self, block: bool = False, until: _Pending | None = None) -> None:
        """Compare every pending snapshot whose flag has landed (all of them with ``block``;
        with ``until``, only the snapshots up to that one, whose copy has landed).

        Raises:
            MirrorDivergence: the first divergence found (also one found earlier while the
                trace recorded a check, :meth:`_check_fields`).
        """
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._unshared is not None:
            raise RuntimeError("mirror check: snapshot(later=True) without share()")
        while self.pending:
            p = self.pending[0]
            if not block and until is None and not p.landed():
                return
            p.wait()
            self.pending.pop(0)
            self._compare(p)
            if p is until:
                return

    def _compare(self, p: _Pending) -> None:
        """The verdict of ``p``: its flag (fields and block counts, compared on the device) and
        its token digests. Only a set flag unpacks the layout and looks field by field."""
        self.checked_steps += 1
        try:
            if self.dev.flag_np[p.buf]:   # the device saw a difference: name it
                name_divergence(self.state, self.dev, p)
            tokens = self.state.tokens
            if tokens is not None and p.tag >= 0:
                tokens.drain(p.tag)
                tokens.check(self.dev.tok_np[p.buf], p.live, p.step, self.state.mirror.rank, p.owners,
                             lambda s: self.state.all_token_ids[s].cpu().numpy())
        except MirrorDivergence as exc:
            p.verdict = (False, str(exc))
            raise
        p.verdict = (True, None)
