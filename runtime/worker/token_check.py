"""Exact host copy of a rank's token ids, and the per-slot digests that check them (issue #27).

A step reads ``DeviceState.all_token_ids`` ``[max_num_reqs, max_model_len]`` int64: rank 0 gathers
its input ids there (prompt ids for prefill rows, the last sampled id for decode rows), the last
rank reads the output ids as the penalties' history, the n-gram proposer and prompt logprobs
read it too. It is written at admission (the replicated prompt ids) and by the sampled
post-update (the ids of the deferred broadcast, or the last rank's own sample), and with
speculative decoding by the drafts rank 0 and the last rank write ahead (:meth:`write`). The host never
needed those ids on a non-last rank, so :class:`TokenMirror` keeps them by one non-blocking copy
of each applied ``[num_rows, width]`` sampled block to pinned memory (:meth:`record`; a few
buffers, reused once their ids are applied: no allocation per step), applied to the host copy
once it has landed (:meth:`drain`).

The check compares, for every live slot, the digest of the whole row ``sum_p ids[s, p] * V_p mod
2**64`` (``V_p``: odd 64-bit constants, :func:`position_weights`): on the device one multiply and
one row sum, travelling with the after-step check's flag; on the host kept incrementally
(each write adds ``(new - old) * V_p``). A write of a wrong id, at a wrong position or into a
wrong slot, and any later change of a row, changes that row's digest (one id changed by ``d``
changes it by ``d * V_p != 0``). The comparison of step ``t`` runs when its flag has landed, after
the ids sampled up to step ``t`` have been applied to the host copy, so it is exact for the state
at the end of step ``t``: the same "within one step" as the other fields. A healthy step compares
the digests of every slot with one ``memcmp`` (the host copy follows every device write, live
slot or not); only a difference looks at the live slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ppstate.errors import MirrorDivergence

_MASK = (1 << 64) - 1


class _Write:
    """One recorded write, applied by :meth:`TokenMirror.drain` once its ids have landed.

    ``host``: the ids ``[R, width]`` (pinned tensor, numpy array, :class:`_Rows`, or None until
    attached); ``slots``, ``start``, ``num``: ``[R]`` int64; ``buf``: the pinned buffer to give
    back (or None); ``rows``: the sampled block's rows that write (None: all) until attached.
    One id per row (a decode step without drafts) keeps ``idx`` (``[R]`` flat index into
    ``ids_np``) and ``wts`` (``[R]`` uint64 ``V_start``) instead of ``start`` / ``num``.
    """

    __slots__ = ("tag", "host", "slots", "start", "num", "buf", "rows", "idx", "wts")

    def __init__(self, tag, host, slots, start=None, num=None, buf=None, rows=None, idx=None,
                 wts=None) -> None:
        self.tag, self.host, self.slots, self.start, self.num = tag, host, slots, start, num
        self.buf, self.rows, self.idx, self.wts = buf, rows, idx, wts


class _Rows:
    """Rows ``rows`` (``[R']``) of an attached host copy ``host`` ``[R, w]`` (the rows that write)."""

    def __init__(self, host: torch.Tensor, rows: np.ndarray) -> None:
        self.host, self.rows = host, rows


def position_weights(n: int) -> np.ndarray:
    """``[n]`` uint64 odd weights ``V_0 .. V_{n-1}`` (splitmix64 of ``p + 2**32``, low bit set)."""
    out = np.empty(n, dtype=np.uint64)
    for p in range(n):
        x = (p + (1 << 32) + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        out[p] = (x ^ (x >> 31)) | 1
    return out


class TokenMirror:
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
        self._flat = self.ids_np.reshape(-1)   # [max_num_reqs * max_model_len] view: take / put
        self._ones = np.ones(max_num_reqs, dtype=np.int64).tobytes()   # num of a decode step
        self._w = position_weights(max_model_len)                    # [max_model_len] uint64
        self.weights = torch.from_numpy(self._w.view(np.int64).copy()).to(device)
        self.digest_np = np.zeros(max_num_reqs, dtype=np.uint64)       # [max_num_reqs]
        self.pending: list[_Write] = []   # recorded, not applied yet (oldest first)
        self._free: list[torch.Tensor] = []   # pinned [max_num_reqs, cols] buffers not in use
        self.tag = 0                     # snapshots started so far (a write's tag: the next one)
        self._unattached: _Write | None = None   # a record(later=True) waiting for attach

    def resync(self, all_token_ids: torch.Tensor) -> None:
        """Start from the device's ids as they are (a device read; nothing may be pending)."""
        self.ids_np[:] = all_token_ids.cpu().numpy()
        self.digest_np[:] = (self.ids_np.view(np.uint64) * self._w).sum(axis=1, dtype=np.uint64)
        self.pending.clear()
        self._unattached = None

    def admit(self, slot: int, ids: Sequence[int]) -> None:
        """The admission's write ``ids[slot, :len(ids)] = ids``."""
        new = np.asarray(ids, dtype=np.int64)
        m = new.size
        old = self.ids_np[slot, :m]
        with np.errstate(over="ignore"):   # the digest wraps mod 2**64 on purpose
            self.digest_np[slot] += ((new - old).view(np.uint64) * self._w[:m]).sum(dtype=np.uint64)
        self.ids_np[slot, :m] = new

    def record(self, sampled: torch.Tensor, slots: np.ndarray, start: np.ndarray,
               num: np.ndarray, later: bool = False) -> None:
        """The sampled post-update's writes: row ``r`` writes ``sampled[r, :num[r]]`` at positions
        ``start[r] ..`` (below ``max_model_len``) of slot ``slots[r]`` (``-1``: skipped). On
        CUDA the ids are copied now (non-blocking) into a pinned buffer reused once applied, and
        applied by :meth:`drain`; the arrays are copied (the caller may reuse them).

        Args:
            later: CUDA only: make no copy; the caller hands over a pinned host copy of
                ``sampled`` (``[R, >= 1]``, landed by the time the next snapshot's event has
                completed) with :meth:`attach` before that snapshot is compared (the last rank:
                the step's result copy, which it makes anyway).
        """
        w = self._one_per_row(slots, start, num)
        if w is None:
            w = self._rows_that_write(slots, start, num)
            if w is None:
                return
        if self.device.type == "cpu":
            ids = sampled.numpy()
            self._apply_write(ids if w.rows is None else ids[w.rows], w)
            return
        if later:   # ids from the caller's copy (attach); rows kept to select them then
            self.pending.append(w)
            self._unattached = w
            return
        src = sampled
        if sampled.shape[1] > 1 and w.idx is not None:   # one id per row: column 0 only (#33)
            src = sampled = sampled[:, :1]
        if w.rows is not None and w.rows.size != sampled.shape[0]:
            src = sampled.index_select(0, torch.from_numpy(w.rows).to(sampled.device,
                                                                      non_blocking=True))
        w.buf = self._pinned(src.shape[1])
        w.host, w.rows = w.buf[:src.shape[0]], None
        w.host.copy_(src, non_blocking=True)
        self.pending.append(w)

    def _one_per_row(self, slots: np.ndarray, start: np.ndarray, num: np.ndarray):
        """The :class:`_Write` of a step whose every row writes one id below ``max_model_len``
        (decode without drafts; its flat indices and weights computed now, a few calls of
        ``[R]`` each), or None (another step: :meth:`_rows_that_write`)."""
        r = slots.size
        if (not r or num.dtype != np.int64 or num.tobytes() != self._ones[:8 * r]
                or slots.min() < 0 or start.max() >= self.max_model_len):
            return None
        idx = np.multiply(slots, self.max_model_len, dtype=np.int64)   # a new array
        idx += start
        return _Write(self.tag, None, slots.astype(np.int64), idx=idx, wts=self._w.take(start))

    def _rows_that_write(self, slots: np.ndarray, start: np.ndarray, num: np.ndarray):
        """The :class:`_Write` of any step (rows without a slot or an id dropped; None when no
        row writes)."""
        rows = None
        if not (slots.size and slots.min() >= 0 and num.min() > 0):   # some row writes nothing
            keep = (slots >= 0) & (num > 0)
            if not keep.any():
                return None
            rows = np.flatnonzero(keep)
            slots, start, num = slots[rows], start[rows], num[rows]
        return _Write(self.tag, None, slots.astype(np.int64), start.astype(np.int64),
                      num.astype(np.int64), rows=rows)

    def attach(self, host: torch.Tensor) -> None:
        """The ids of the last ``record(..., later=True)``: ``host`` ``[R, >= 1]`` int64 pinned,
        the sampled block as recorded (all its rows), valid once the copy enqueued before the
        next snapshot's event has landed. No-op when nothing waits for ids."""
        w = self._unattached
        if w is None:
            return
        self._unattached = None
        w.host = host if w.rows is None else _Rows(host, w.rows)
        w.rows = None

    def _pinned(self, cols: int) -> torch.Tensor:
        """A pinned ``[max_num_reqs, cols]`` int64 buffer not in use: from the free list, or
        made once (:meth:`drain` gives it back once its ids are applied)."""
        for i, buf in enumerate(self._free):
            if buf.shape[1] == cols:
                return self._free.pop(i)
        return torch.empty(self.ids_np.shape[0], cols, dtype=torch.int64, pin_memory=True)

    def write(self, slot: int, start: int, ids: np.ndarray) -> None:
        """A write whose ids the host knows (speculative drafts, ``[k]``): ``ids[slot, start ..]``
        (below ``max_model_len``), in order after the sampled writes recorded before it."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        w = _Write(self.tag, ids, np.array([slot]), np.array([start]), np.array([ids.shape[1]]))
        if self.device.type == "cpu":
            self._apply_write(ids, w)
        else:
            self.pending.append(w)

    def drain(self, tag: int) -> None:
        """Apply the recorded writes of snapshots up to ``tag`` (their copies landed: each was
        enqueued before that snapshot's event, which has completed).

        Raises:
            RuntimeError: a ``record(..., later=True)`` whose ids were never attached.
        """
        while self.pending and self.pending[0].tag <= tag:
            w = self.pending.pop(0)
            host = w.host
            if host is None:
                raise RuntimeError("token mirror: sampled ids recorded for later, never attached")
            if isinstance(host, _Rows):
                ids = host.host.numpy()[host.rows]
            else:
                ids = host.numpy() if isinstance(host, torch.Tensor) else host
            self._apply_write(ids, w)
            if w.buf is not None:
                self._free.append(w.buf)   # its ids are in the host copy: reusable

    def _apply_write(self, ids: np.ndarray, w: _Write) -> None:
        """Write ``w`` with its ids ``[R, width]`` int64 (a step's slots are distinct)."""
        if w.idx is not None:   # one id per row, indices and weights known (decode)
            self._apply_one_at(ids[:, 0], w)
        else:
            self._apply(ids, w.slots, w.start, w.num)

    def _apply_one_at(self, new: np.ndarray, w: _Write) -> None:
        """One id per row (``new`` ``[R]`` int64) at ``w``'s flat indices ``w.idx``, weights
        ``w.wts`` and slots ``w.slots`` (``[R]`` each, from :meth:`_one_per_row`): eight calls
        of ``[R]`` elements."""
        d = (new - self._flat.take(w.idx)).view(np.uint64)
        d *= w.wts                                                      # wraps mod 2**64
        g = self.digest_np.take(w.slots)
        g += d
        self.digest_np.put(w.slots, g)
        self._flat.put(w.idx, new)

    def _apply(self, ids: np.ndarray, slots: np.ndarray, start: np.ndarray,
               num: np.ndarray) -> None:
        """One step's writes (``ids`` ``[R, width]`` int64; ``slots``, ``start``, ``num`` ``[R]``
        int64; a step's slots are distinct)."""
        # every num >= 1 here (record drops rows without ids): max 1 = one id per row
        if (ids.shape[1] == 1 or num.max() == 1) and start.max() < self.max_model_len:
            self._apply_one(ids[:, 0], slots, start)   # decode, no drafts (any width: #33)
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

    def _apply_one(self, new: np.ndarray, slots: np.ndarray, start: np.ndarray) -> None:
        """One id per row (``new``, ``slots``, ``start`` ``[R]`` int64; positions below
        ``max_model_len``): a decode step without drafts, whatever the payload's width."""
        flat = self.ids_np.reshape(-1)   # a view: take / put on flat indices are the cheapest
        idx = slots * self.max_model_len + start                                 # [R]
        terms = (new - flat.take(idx)).view(np.uint64) * self._w.take(start)    # wraps mod 2**64
        self.digest_np.put(slots, self.digest_np.take(slots) + terms)
        flat.put(idx, new)

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
        if device_digest.tobytes() == host.tobytes():   # every slot's row agrees: one memcmp
            return
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
