"""The mirror check as it was before its per-step host cost was cut (main at 9fb95f0, 2026-12-02),
kept verbatim to measure against in one run: ``python -m runtime.bench mirror`` alternates off, on
(:mod:`runtime.worker.mirror_check`, :mod:`runtime.worker.token_check`) and this, reported as
``before_*``. Only the class names differ (:class:`BeforeCheck` was ``AsyncMirrorCheck``,
:class:`BeforeTokens` was ``TokenMirror``): the same coverage; per step it builds the flat layout's
views anew, makes a new CUDA event, tests the block counts on the host, copies each step's sampled
ids to a new pinned tensor and compares the live slots' token digests by fancy indexing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ppstate.errors import MirrorDivergence
from ppstate.events import NULL_SINK, EventSink
from ppstate.mirror import MIRROR_FIELDS, CpuMirror
from runtime.host_copy import to_device
from runtime.worker import state_check

def m_slots(state) -> int:
    """Slots of ``state`` (``max_num_reqs``)."""
    return state.block_table_np.shape[0]


@dataclass
class _Pending:
    step: int
    buf: int                       # index of the double-buffered host / device arrays in use
    live: np.ndarray               # [num_live] slots compared
    owners: list                   # [max_num_reqs] req ids at snapshot time
    event: object | None
    cols: int = 1                  # block-table columns in the flat layout
    biased: np.ndarray | None = None   # [B] biased live slots whose logit-bias rows follow
    size: int = 0                  # int32 words of the flat layout
    tag: int = -1                  # TokenMirror tag: its writes recorded before this snapshot
    verdict: tuple[bool, str | None] | None = None   # (ok, message) once compared


class BeforeCheck:
    """Double-buffered snapshots of one rank's device state, compared on the device.

    Args:
        state: the rank's DeviceState (device tensors ``[max_num_reqs]`` int64, ``mirror``,
            ``owner``, ``live_slots()``, ``block_size``).
        sink: where ``mirror.check`` events go when it is enabled (tracing); rank: their rank.
    """

    def __init__(self, state, sink: EventSink = NULL_SINK, rank: int | None = None) -> None:
        self.state, self.sink, self.rank = state, sink, rank
        self._pin = state.device.type == "cuda"
        self.capacity = 0
        self._graphs: list | None = None   # CUDA: the device work of each buffer, one graph each
        self._grow(state_check.flat_size(*state.block_table_np.shape))   # the most columns
        self.flag_host = torch.zeros(2, dtype=torch.bool, pin_memory=self._pin)   # [2] per buffer
        self.flag_np = self.flag_host.numpy()
        n = m_slots(state)   # the token rows' digests (runtime/worker/token_check.py), [2, n]
        self.tok_dev = torch.zeros(2, n, dtype=torch.int64, device=state.device)
        self.tok_host = torch.zeros(2, n, dtype=torch.int64, pin_memory=self._pin)
        self.tok_np = self.tok_host.numpy()
        self._nct = MIRROR_FIELDS.index("num_computed_tokens")
        self._nb = MIRROR_FIELDS.index("num_blocks")
        self.pending: list[_Pending] = []
        self._error: MirrorDivergence | None = None   # found while recording, raised next
        self.checked_steps = 0
        self.use_graphs = self._pin
        self._graphed_tokens = None   # the TokenMirror whose digests the graphs compute

    def _enqueue(self, k: int, size: int, cols: int, bl: np.ndarray) -> None:
        """The device work of buffer ``k`` (stream order): expected values in, the snapshot, the
        comparison reduced to one flag, the flag out."""
        exp_d, snap = self.exp_dev[k, :size], self.snap_dev[k, :size]
        exp_d.copy_(self.exp_host[k, :size], non_blocking=True)
        st = self.state
        state_check.device_flat(st, cols, to_device(bl, st.device) if bl.size else None, out=snap)
        self.flag_host[k:k + 1].copy_(torch.ne(snap, exp_d).any().view(1), non_blocking=True)
        if st.tokens is not None:   # compared on the host when the sampled ids have landed too
            st.tokens.device_digest(st.all_token_ids, self.tok_dev[k])
            self.tok_host[k].copy_(self.tok_dev[k], non_blocking=True)

    def _graph(self, k: int):
        """Buffer ``k``'s device work over every block-table column and no logit-bias rows,
        captured once as a CUDA graph (one launch per step instead of five); None when capture
        fails (then the work is enqueued op by op)."""
        if self._graphs is None:
            cols = self.state.block_table_np.shape[1]
            size = state_check.flat_size(m_slots(self.state), cols)
            none = np.zeros(0, dtype=np.int64)
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):            # warm-up outside the capture
                    for b in range(2):
                        self._enqueue(b, size, cols, none)
                torch.cuda.current_stream().wait_stream(side)
                graphs = []
                for b in range(2):   # thread_local: other threads' CUDA calls stay legal
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, capture_error_mode="thread_local"):
                        self._enqueue(b, size, cols, none)
                    graphs.append(g)
                torch.cuda.synchronize()
                self._graphs = graphs
            except Exception:   # capture not supported here: op by op from now on
                self.use_graphs, self._graphs = False, None
                torch.cuda.synchronize()
                return None
        return self._graphs[k]

    def _grow(self, size: int) -> None:
        """Buffers for a flat layout of ``size`` int32 words (only while nothing is pending):
        expected values, pinned ``[2, size]`` and on the device; the device snapshot ``[2, size]``."""
        if size <= self.capacity:
            return
        dev = self.state.device
        self.capacity, self._graphs = size, None   # the graphs read the old buffers: recapture
        self.exp_host = torch.empty(2, size, dtype=torch.int32, pin_memory=self._pin)
        self.exp_np = self.exp_host.numpy()
        self.exp_dev = torch.empty(2, size, dtype=torch.int32, device=dev)
        self.snap_dev = torch.empty(2, size, dtype=torch.int32, device=dev)

    def snapshot(self, step: int) -> None:
        """Start the check of ``step`` (call after the step's post-update was issued). Finishes
        the previous step's check first (blocking on its flag if still in flight).

        Raises:
            MirrorDivergence: from the previous step's (or, on CPU, this step's) comparison.
        """
        self.poll(block=True)
        st = self.state
        live = st.live_slots()
        if live.size == 0:
            if self.sink.enabled:   # nothing to compare, recorded as the synchronous check does
                self.sink.emit("mirror.check", step=step, rank=self.rank, slots=[],
                               num_computed_tokens=[], ok=True, message=None)
            return
        k = step % 2
        bl = state_check.biased(st, live)
        if st.tokens is not self._graphed_tokens:   # token check switched on / off: recapture
            self._graphs, self._graphed_tokens = None, st.tokens
        graph = self._graph(k) if self.use_graphs and not bl.size else None
        cols = st.block_table_np.shape[1] if graph is not None else state_check.used_cols(st, live)
        size = state_check.flat_size(m_slots(st), cols, bl.size, state_check.bias_width(st))
        self._grow(size)
        state_check.host_flat(st, cols, self.exp_np[k, :size], bl)
        if graph is not None:
            graph.replay()
        else:
            self._enqueue(k, size, cols, bl)
        event = None
        if self._pin:
            event = torch.cuda.Event()
            event.record()
        p = _Pending(step, k, live, list(st.owner), event, cols, bl, size)
        if st.tokens is not None:
            p.tag, st.tokens.tag = st.tokens.tag, st.tokens.tag + 1
        self.pending.append(p)
        if self.sink.enabled:
            values = st.mirror.num_computed_tokens_np[live].tolist()
            self.sink.emit_when(lambda: p.verdict is not None or p.event is None
                                or p.event.query(), "mirror.check", step, self.rank,
                                lambda: self._check_fields(p, values))
        if event is None:
            self.poll(block=True)

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
        while self.pending:
            p = self.pending[0]
            if p.event is not None:
                if not block and until is None and not p.event.query():
                    return
                p.event.synchronize()
            self.pending.pop(0)
            self._compare(p)
            if p is until:
                return

    def _compare(self, p: _Pending) -> None:
        self.checked_steps += 1
        n = m_slots(self.state)
        exp_flat = self.exp_np[p.buf, :p.size]
        exp = state_check.unpack(exp_flat, n, p.cols)[0]                  # [F, max_num_reqs]
        bs, slack = self.state.block_size, 2 * (self.state.width - 1)  # spec drafts' blocks
        held, computed = exp[self._nb, p.live], exp[self._nct, p.live]   # [num_live] each
        try:
            if self.flag_np[p.buf]:   # the device saw a difference: name the first (field, slot)
                state_check.compare(self.snap_dev[p.buf, :p.size].cpu().numpy(), exp_flat, n,
                                    p.cols, p.live, p.step, self.state.mirror.rank, p.owners,
                                    p.biased, state_check.bias_width(self.state))
            if not ((held >= -(-computed // bs)).all()
                    and (held <= -(-(computed + slack) // bs)).all()):
                self._raise_blocks(p, exp)
            tokens = self.state.tokens
            if tokens is not None and p.tag >= 0:
                tokens.drain(p.tag)
                tokens.check(self.tok_np[p.buf], p.live, p.step, self.state.mirror.rank, p.owners,
                             lambda s: self.state.all_token_ids[s].cpu().numpy())
        except MirrorDivergence as exc:
            p.verdict = (False, str(exc))
            raise
        p.verdict = (True, None)

    def _raise_blocks(self, p: _Pending, exp: np.ndarray) -> None:
        """The first slot of ``p`` whose block count breaks invariant 9, as
        ``CpuMirror.validate_blocks`` names it (``exp``: the counters ``[F, max_num_reqs]``)."""
        expected = CpuMirror(exp.shape[1], rank=self.state.mirror.rank)
        for i, f in enumerate(MIRROR_FIELDS):
            np.copyto(expected.array(f), exp[i])
        expected.validate_blocks(self.state.block_size, p.live, p.step, owners=p.owners,
                                 spec_slack=2 * (self.state.width - 1))


_MASK = (1 << 64) - 1


def position_weights(n: int) -> np.ndarray:
    """``[n]`` uint64 odd weights ``V_0 .. V_{n-1}`` (splitmix64 of ``p + 2**32``, low bit set)."""
    out = np.empty(n, dtype=np.uint64)
    for p in range(n):
        x = (p + (1 << 32) + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        out[p] = (x ^ (x >> 31)) | 1
    return out


class BeforeTokens:
    """Host copy of ``all_token_ids`` and each row's digest.

    Args:
        max_num_reqs, max_model_len: the shape of ``all_token_ids``.
        device: where ``all_token_ids`` lives (on the CPU a write is applied at once).

    Attributes:
        ids_np: ``[max_num_reqs, max_model_len]`` int64 host copy.
        digest_np: ``[max_num_reqs]`` uint64 digest of each host row.
        weights: ``[max_model_len]`` int64 ``V_p`` on ``device`` (products wrap mod 2**64).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device) -> None:
        self.device, self.max_model_len = device, max_model_len
        self.ids_np = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self._w = position_weights(max_model_len)                    # [max_model_len] uint64
        self.weights = torch.from_numpy(self._w.view(np.int64).copy()).to(device)
        self.digest_np = np.zeros(max_num_reqs, dtype=np.uint64)       # [max_num_reqs]
        self.pending: list[tuple] = []   # (tag, host ids [R, width], slots, pos, num)
        self.tag = 0                     # snapshots started so far (a write's tag: the next one)

    def resync(self, all_token_ids: torch.Tensor) -> None:
        """Start from the device's ids as they are (a device read; nothing may be pending)."""
        self.ids_np[:] = all_token_ids.cpu().numpy()
        self.digest_np[:] = (self.ids_np.view(np.uint64) * self._w).sum(axis=1, dtype=np.uint64)
        self.pending.clear()

    def admit(self, slot: int, ids: Sequence[int]) -> None:
        """The admission's write ``ids[slot, :len(ids)] = ids``."""
        new = np.asarray(ids, dtype=np.int64)
        m = new.size
        old = self.ids_np[slot, :m]
        with np.errstate(over="ignore"):   # the digest wraps mod 2**64 on purpose
            self.digest_np[slot] += ((new - old).view(np.uint64) * self._w[:m]).sum(dtype=np.uint64)
        self.ids_np[slot, :m] = new

    def record(self, sampled: torch.Tensor, slots: np.ndarray, start: np.ndarray,
               num: np.ndarray) -> None:
        """The sampled post-update's writes: row ``r`` writes ``sampled[r, :num[r]]`` at positions
        ``start[r] ..`` (below ``max_model_len``) of slot ``slots[r]`` (``-1``: skipped). On
        CUDA the ids are copied to pinned memory now and applied by :meth:`drain`."""
        keep = (slots >= 0) & (num > 0)
        if not keep.any():
            return
        rows = np.flatnonzero(keep)
        if self.device.type == "cpu":
            self._apply(sampled.numpy()[rows], slots[rows], start[rows], num[rows])
            return
        idx = torch.from_numpy(rows).to(sampled.device, non_blocking=True) \
            if rows.size != slots.size else None
        src = sampled if idx is None else sampled.index_select(0, idx)
        self.pending.append((self.tag, src.to("cpu", non_blocking=True), slots[rows],
                             start[rows], num[rows]))

    def write(self, slot: int, start: int, ids: np.ndarray) -> None:
        """A write whose ids the host knows (speculative drafts, ``[k]``): ``ids[slot, start ..]``
        (below ``max_model_len``), in order after the sampled writes recorded before it."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        args = (np.array([slot]), np.array([start]), np.array([ids.shape[1]]))
        if self.device.type == "cpu":
            self._apply(ids, *args)
        else:
            self.pending.append((self.tag, ids, *args))

    def drain(self, tag: int) -> None:
        """Apply the recorded writes of snapshots up to ``tag`` (their copies landed: each was
        enqueued before that snapshot's event, which has completed)."""
        while self.pending and self.pending[0][0] <= tag:
            _, host, slots, start, num = self.pending.pop(0)
            self._apply(host if isinstance(host, np.ndarray) else host.numpy(), slots, start, num)

    def _apply(self, ids: np.ndarray, slots: np.ndarray, start: np.ndarray,
               num: np.ndarray) -> None:
        """One step's writes (``ids`` ``[R, width]``; ``slots``, ``start``, ``num`` ``[R]``; a
        step's slots are distinct)."""
        slots = slots.astype(np.int64)
        if ids.shape[1] == 1 and (start < self.max_model_len).all():   # decode, no drafts
            pos, new = start.astype(np.int64), ids[:, 0].astype(np.int64)
            old = self.ids_np[slots, pos]
            self.digest_np[slots] += (new - old).view(np.uint64) * self._w[pos]
            self.ids_np[slots, pos] = new
            return
        cols = np.arange(ids.shape[1])
        pos = start[:, None].astype(np.int64) + cols[None, :]             # [R, width]
        write = (cols[None, :] < num[:, None]) & (pos < self.max_model_len)
        p = np.where(write, pos, 0)
        s = np.broadcast_to(slots[:, None], pos.shape)
        old = self.ids_np[s, p]
        terms = np.where(write, (ids.astype(np.int64) - old).view(np.uint64) * self._w[p],
                         np.uint64(0))
        self.digest_np[slots] += terms.sum(axis=1, dtype=np.uint64)
        self.ids_np[s[write], pos[write]] = ids[write].astype(np.int64)

    def device_digest(self, all_token_ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` ``[max_num_reqs]`` int64 = each device row's digest (enqueued)."""
        torch.sum(all_token_ids * self.weights, dim=1, out=out)

    def check(self, device_digest: np.ndarray, live: np.ndarray, step: int, rank: int | None,
              owners: Sequence[str | None], device_row=None) -> None:
        """Compare the device digests ``[max_num_reqs]`` int64 with the host's on ``live``.

        Args:
            device_row: ``slot -> [max_model_len]`` the device row now, to name the first
                divergent position (the digests tell only the slot).

        Raises:
            MirrorDivergence: field ``all_token_ids[p]`` (``cpu`` / ``device``: the ids there)
                or, when the rows agree by now, ``all_token_ids (digest)`` with both digests.
        """
        host = self.digest_np.view(np.int64)
        bad = np.flatnonzero(device_digest[live] != host[live])
        if not bad.size:
            return
        slot = int(live[bad[0]])
        field, cpu, dev = "all_token_ids (digest)", int(host[slot]), int(device_digest[slot])
        if device_row is not None:
            row = device_row(slot)
            diff = np.flatnonzero(row != self.ids_np[slot])
            if diff.size:
                p = int(diff[0])
                field, cpu, dev = f"all_token_ids[{p}]", int(self.ids_np[slot, p]), int(row[p])
        raise MirrorDivergence(step=step, slot=slot, field=field, cpu=cpu, device=dev,
                               req_id=owners[slot], rank=rank)
