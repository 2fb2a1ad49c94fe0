"""Deferred consume of the last rank's sampled tokens on non-last PP ranks (the ``PPHandler`` FIFO).

The last rank samples each step's tokens and broadcasts them on a side group; earlier ranks post
the receive but apply it only ``depth`` steps later (``depth = pp_size`` in overlapped mode, 1 in
sync mode), just before the requests of that step can be scheduled again. The queue entry machine
is ``specs/pp_handler.yaml`` (empty -> pending -> consumed; free bumps a generation); its guard
(``mask_nonempty``) and effect (``bump_generation``) are methods of :class:`PPHandler`, bound
when the first handler is built (:mod:`ppstate.table_binding`).

Invariant 1 (collective matching): :func:`need_sampled_mask` and :func:`should_broadcast` are pure
functions of the replicated :class:`~ppstate.batch.SchedulerOutput`, so every rank takes the same
post / skip decision. Invariant 2 (no stale application): :meth:`PPHandler.consume` turns rows whose
slot generation changed since enqueue into ``-1``.

Sources: vLLM Model Runner V2 ``worker/gpu/pp_utils.py`` (``PPHandler``, ``PendingRecv``,
``compute_need_sampled_mask``) and vLLM V1 ``_is_all_reqs_chunked_prefill`` (the broadcast skip for
all-non-final-chunk steps that fixed the chunked-PP hang).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput
from ppstate.errors import PPStateError, SlotError
from ppstate.events import NULL_SINK, EventSink
from ppstate.state_tables import load_table
from ppstate.table_binding import bind_effects, check_guards, to_machine


def need_sampled_mask(out: SchedulerOutput) -> np.ndarray | None:
    """Rows whose sampled token someone needs: every row that is not a non-final prefill chunk.

    Deliberately no "not finishing" term (it went wrong with speculative decoding in vLLM):
    finished requests are filtered by the generation check on consume instead.

    Returns:
        ``[num_rows]`` bool copy of ``out.is_final_chunk``, or None when no row needs a sample
        (empty step, or every row a non-final chunk): then no broadcast and no receive happen.
    """
    if out.num_rows == 0:
        return None
    mask = np.array(out.is_final_chunk, dtype=bool)   # a copy
    return mask if np.count_nonzero(mask) else None


def should_broadcast(out: SchedulerOutput) -> bool:
    """Last rank's side of invariant 1: post the broadcast iff :func:`need_sampled_mask` is not None."""
    return need_sampled_mask(out) is not None


@dataclass(frozen=True)
class ConsumedEntry:
    """A deferred receive taken off the FIFO, ready for the device post-update.

    Attributes:
        step: the step whose broadcast this is.
        idx_mapping: ``[num_rows]`` int64 slot per row; ``-1`` for rows that needed no sample or
            whose slot was freed (and maybe reused) since enqueue. Kernels must skip ``-1`` rows.
        handle: the caller's completion handle / buffers given to :meth:`PPHandler.enqueue`.
        mask: ``[num_rows]`` bool need-sampled mask of the step.
    """
    step: int
    idx_mapping: np.ndarray
    handle: Any
    mask: np.ndarray

    def __init__(self, step: int, idx_mapping: np.ndarray, handle: Any, mask: np.ndarray) -> None:
        d = self.__dict__   # written out, as SchedulerOutput's: one per step
        d["step"], d["idx_mapping"], d["handle"], d["mask"] = step, idx_mapping, handle, mask


@dataclass(frozen=True)
class _Pending:
    """A posted receive: the step's ``idx_mapping`` and the generation snapshot of its slots."""
    step: int
    idx_mapping: np.ndarray   # [num_rows] int64
    mask: np.ndarray          # [num_rows] bool
    generations: np.ndarray   # [num_rows] int64, generation of each row's slot at enqueue
    handle: Any

    def __init__(self, step: int, idx_mapping: np.ndarray, mask: np.ndarray,
                 generations: np.ndarray, handle: Any) -> None:
        d = self.__dict__   # written out, as SchedulerOutput's: one per step
        d["step"], d["idx_mapping"], d["mask"] = step, idx_mapping, mask
        d["generations"], d["handle"] = generations, handle


class PPHandler:
    """FIFO of exactly ``depth`` entries, each None (empty) or a pending receive.

    Per step the caller does, in this order: :meth:`consume` (pops the entry of step
    ``step - depth``), then :meth:`enqueue` (pushes this step's entry, empty when the mask is None);
    for a step number the scheduler skipped, :meth:`consume` then :meth:`push_empty`
    (:class:`~ppstate.rank_step.RankStep`), so entries stay ``depth`` numbers apart.
    :meth:`on_slot_freed` is called whenever the worker frees a slot. :attr:`num_dropped`
    counts the rows that needed a sample and were dropped as stale (finished, aborted or
    preempted since enqueue): how often the generation check fired.

    Args:
        depth: steps between enqueue and consume (``pp_size`` overlapped, 1 sync); >= 1.
        max_num_reqs: number of slots.
        sink: event sink (``pp.enqueue`` / ``pp.consume`` / ``pp.free``).
        rank: PP rank owning this handler (named in events).

    Raises:
        SlotError: ``depth < 1`` or ``max_num_reqs < 1``.
    """

    def __init__(self, depth: int, max_num_reqs: int, sink: EventSink = NULL_SINK,
                 rank: int | None = None) -> None:
        if depth < 1 or max_num_reqs < 1:
            raise SlotError(f"PPHandler needs depth >= 1 and max_num_reqs >= 1, got {depth}, "
                            f"{max_num_reqs}")
        _effects()   # the table is bound to this class (TableError at the first handler otherwise)
        self.depth, self.max_num_reqs, self.sink, self.rank = depth, max_num_reqs, sink, rank
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs]
        self._fifo: deque[_Pending | None] = deque([None] * depth)
        self._expect_enqueue = False
        self.num_dropped = 0   # rows that needed a sample, dropped as stale (the safety net fired)

    def __len__(self) -> int:
        return len(self._fifo)

    def pending_steps(self) -> list[int]:
        """Steps whose receive is posted and not yet consumed, oldest first."""
        return [e.step for e in self._fifo if e is not None]

    def on_slot_freed(self, idx: int, step: int = -1) -> None:
        """Slot ``idx`` was freed (at ``step``, named in the event): bump its generation so
        queued rows for it go stale."""
        for name in _effects()["free"]:   # specs/pp_handler.yaml: bump_generation
            getattr(self, name)(idx)
        if self.sink.enabled:
            self.sink.emit("pp.free", step=step, rank=self.rank, slot=int(idx),
                           generation=int(self.generation[idx]))

    def bump_generation(self, idx: int) -> None:
        """Effect of ``free``: slot ``idx``'s generation += 1."""
        self.generation[idx] += 1

    @staticmethod
    def mask_nonempty(mask: np.ndarray | None) -> bool:
        """Guard of ``enqueue``: some row of the step needs its sample (:func:`need_sampled_mask`
        returns None otherwise)."""
        return mask is not None

    def enqueue(self, step: int, out: SchedulerOutput, mask: np.ndarray | None,
                handle: Any = None) -> None:
        """Push this step's entry: pending when ``mask`` is not None, else empty.

        Args:
            step: the step (``out.step``).
            out: the step's scheduler output (its ``slots`` become the idx_mapping).
            mask: ``[num_rows]`` bool from :func:`need_sampled_mask`, or None.
            handle: opaque completion handle / receive buffers, returned by :meth:`consume`.

        Raises:
            PPStateError: called twice without a :meth:`consume` in between (FIFO would grow).
        """
        if not self._expect_enqueue:
            raise PPStateError(f"rank {self.rank} step {step}: enqueue without consume first")
        self._expect_enqueue = False
        if not self.mask_nonempty(mask):   # the table's guard of ``enqueue``
            self._fifo.append(None)
        else:
            idx = np.array(out.slots, dtype=np.int64)   # a copy; the generations' gather too
            self._fifo.append(_Pending(step, idx, np.asarray(mask, dtype=bool),
                                       self.generation[idx], handle))
        if self.sink.enabled:
            self.sink.emit("pp.enqueue", step=step, rank=self.rank, pending=mask is not None)

    def push_empty(self, step: int) -> None:
        """Push an empty entry for ``step`` (same as ``enqueue(step, ..., mask=None)``)."""
        self.enqueue(step, SchedulerOutput.empty(step), None)

    def consume(self) -> ConsumedEntry | None:
        """Pop the oldest entry (posted ``depth`` steps ago).

        Returns:
            The entry with stale / unneeded rows set to ``-1``, or None when the entry was empty or
            no row is usable. Handles with a ``wait()`` method are waited on first, also when no
            row is usable, so the receive buffer is free for reuse.

        Raises:
            PPStateError: called twice without an :meth:`enqueue` in between.
        """
        if self._expect_enqueue:
            raise PPStateError(f"rank {self.rank}: consume twice without enqueue")
        self._expect_enqueue = True
        entry = self._fifo.popleft()
        if entry is None:
            return None
        if callable(getattr(entry.handle, "wait", None)):
            entry.handle.wait()
        idx = entry.idx_mapping    # the entry's own copy (made by enqueue), no longer queued
        unusable = self._stale_rows(entry)
        if mutants.active("no_generation_check"):  # model checker's mutant; never on in runs
            unusable[:] = False
        dropped = 0
        if np.count_nonzero(unusable):   # stale rows: their slot was freed since enqueue
            dropped = int(np.count_nonzero(unusable & entry.mask))
            self.num_dropped += dropped
        if np.count_nonzero(entry.mask) < idx.size:  # rows that need no sample
            unusable |= ~entry.mask
        num_unusable = np.count_nonzero(unusable)
        if num_unusable:
            idx[unusable] = -1
        if self.sink.enabled:
            self.sink.emit("pp.consume", step=entry.step, rank=self.rank,
                           idx_mapping=idx.tolist(), dropped=dropped)
        if num_unusable == idx.size:
            return None
        return ConsumedEntry(entry.step, idx, entry.handle, entry.mask)

    def _stale_rows(self, entry: _Pending) -> np.ndarray:
        """``[num_rows]`` bool: rows whose slot was freed since enqueue (invariant 2)."""
        return self.generation[entry.idx_mapping] != entry.generations


@lru_cache(maxsize=None)
def _effects() -> dict[str, tuple[str, ...]]:
    """trigger -> effect methods of :class:`PPHandler`, from ``specs/pp_handler.yaml`` (guards
    and effects checked once per process; its machine is built too, validating the edges)."""
    table = load_table("pp_handler")
    to_machine(table)
    check_guards(table, PPHandler)
    return {"free": (), **bind_effects(table, PPHandler)}
