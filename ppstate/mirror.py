"""CPU mirrors of device-side per-slot state, used for control flow without device syncs.

Each rank keeps these numpy arrays in step with its device tensors: the immediate update adds the
scheduled query length after the forward, the deferred correction subtracts rejected tokens on
consume (0 without speculative decoding). :meth:`CpuMirror.validate` compares the live slots with
the device values after a step (invariant 4) and raises :class:`MirrorDivergence` on the first
difference. Source of the field set: vLLM Model Runner V2 ``input_batch.py`` (PR "Avoid pipeline
parallel bubbles").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ppstate import mutants
from ppstate.errors import MirrorDivergence
from ppstate.scalars import ONE_I64, ZERO_I64

MIRROR_FIELDS = ("num_computed_tokens", "prefill_len", "num_computed_prefill_tokens", "max_seq_len",
                 "num_blocks")
_ROW = {f: i for i, f in enumerate(MIRROR_FIELDS)}   # field -> row of CpuMirror.values


class CpuMirror:
    """The mirror arrays, each ``[max_num_reqs]`` int64, indexed by slot (``num_blocks``: KV blocks
    in the slot's block-table row, from the scheduler's deltas). They are the rows of one
    ``values`` array ``[len(MIRROR_FIELDS), max_num_reqs]``, so that a stacked host copy of the
    device arrays is checked with one comparison (:meth:`validate`). Write them through the
    methods only: :meth:`apply_scheduled` relies on :meth:`add_request` being the only way a slot
    gets prefill left.

    Args:
        max_num_reqs: number of slots.
        rank: the PP rank these mirrors belong to (named in divergence errors).
    """

    def __init__(self, max_num_reqs: int, rank: int | None = None) -> None:
        self.rank = rank
        self.values = np.zeros((len(MIRROR_FIELDS), max_num_reqs), dtype=np.int64)  # [F, max_num_reqs]
        self._derived()

    def rebind(self, values: np.ndarray) -> None:
        """Keep the counters in ``values`` from now on (``[len(MIRROR_FIELDS), max_num_reqs]``
        int64, e.g. a view of a caller's buffer that must hold them), starting from the current
        ones."""
        if values.shape != self.values.shape or values.dtype != self.values.dtype:
            raise ValueError(f"rebind: need {self.values.shape} {self.values.dtype}, "
                             f"got {values.shape} {values.dtype}")
        np.copyto(values, self.values)
        self.values = values
        self._derived()

    def _derived(self) -> None:
        """What is kept beside ``values`` and not pickled: the row views (a view costs a numpy
        call), the block-size constants of :meth:`validate_blocks`, and whether some slot may
        have prefill left (only :meth:`add_request` makes one; True when not known)."""
        self._rows = tuple(self.values)
        self._block_size: tuple[int, np.ndarray, np.ndarray] | None = None
        self._prefill_left = True

    def __getstate__(self) -> dict:
        return {"rank": self.rank, "values": self.values}   # views do not survive a pickle

    def __setstate__(self, state: dict) -> None:
        self.rank, self.values = state["rank"], state["values"]
        self._derived()

    # the fields, as views of their row of ``values`` (each [max_num_reqs] int64)
    num_computed_tokens_np = property(lambda self: self._rows[0])
    prefill_len_np = property(lambda self: self._rows[1])
    num_computed_prefill_tokens_np = property(lambda self: self._rows[2])
    max_seq_len_np = property(lambda self: self._rows[3])
    num_blocks_np = property(lambda self: self._rows[4])

    def array(self, field: str) -> np.ndarray:
        """The mirror array for ``field`` (one of :data:`MIRROR_FIELDS`): a view, ``[max_num_reqs]``."""
        return self._rows[_ROW[field]]

    def add_request(self, slot: int, prefill_len: int, max_seq_len: int,
                    num_cached: int = 0) -> None:
        """Initialise a newly allocated slot (tokens: prefill length, prompt + max_tokens, and the
        prefix-cache hit the first chunk starts after); its block-table row starts empty."""
        self.num_computed_tokens_np[slot] = num_cached
        self.num_computed_prefill_tokens_np[slot] = num_cached
        self.prefill_len_np[slot] = prefill_len
        self.max_seq_len_np[slot] = max_seq_len
        self.num_blocks_np[slot] = 0
        self._prefill_left = True

    def apply_block_updates(self, slots: np.ndarray, cols: np.ndarray) -> None:
        """Block-table deltas: ``num_blocks[slot] = max(num_blocks[slot], col + 1)`` (``[U]``)."""
        if slots.size:
            np.maximum.at(self._rows[4], slots, cols.astype(np.int64) + ONE_I64)  # int64: fast .at

    def validate_blocks(self, block_size: int, live_slots: np.ndarray, step: int,
                        owners: Sequence[str | None] | None = None, spec_slack: int = 0) -> None:
        """KV completeness on the CPU: after a step every live slot holds exactly
        ``ceil(num_computed_tokens / block_size)`` blocks (the scheduler allocates a row's blocks
        in the step that computes its tokens, never more).

        With speculative decoding the scheduler takes blocks for a decode row's ``1 + k`` tokens
        before it knows how many drafts are rejected, and keeps them; ``spec_slack`` (tokens,
        ``2 * num_spec_tokens``: the rejections of this rank's uncorrected row and of one row the
        scheduler had not yet seen corrected) bounds that surplus: a slot then holds between
        ``ceil(n / block_size)`` and ``ceil((n + spec_slack) / block_size)`` blocks.

        Raises:
            MirrorDivergence: field ``num_blocks``, ``cpu`` = blocks held, ``device`` = needed.
        """
        v = self._rows
        if spec_slack == 0:  # every slot, live or not: 0 <= held * block_size - computed < block_size
            if self._block_size is None or self._block_size[0] != block_size:
                self._block_size = (block_size, np.array(block_size, dtype=np.int64),
                                    np.array(block_size, dtype=np.uint64))  # 0-d: numpy's fast path
            _, bs, bs_unsigned = self._block_size
            if not np.count_nonzero((v[4] * bs - v[0]).view(np.uint64) >= bs_unsigned):
                return
        computed = v[0][live_slots]
        need = (computed + (block_size - 1)) // block_size           # ceil
        held = v[4][live_slots]
        if spec_slack == 0:
            bad = (held != need).nonzero()[0]
        else:
            most = -(-(computed + spec_slack) // block_size)
            bad = ((held < need) | (held > most)).nonzero()[0]
        if bad.size:
            slot = int(live_slots[bad[0]])
            raise MirrorDivergence(step=step, slot=slot, field="num_blocks (vs ceil(num_computed_tokens / block_size))",
                                   req_id=owners[slot] if owners is not None else None,
                                   cpu=int(held[bad[0]]), device=int(need[bad[0]]), rank=self.rank)

    def apply_scheduled(self, slots: np.ndarray, num_scheduled_tokens: np.ndarray) -> None:
        """Immediate update after a forward: ``num_computed_tokens += query length``.

        Args:
            slots: ``[num_rows]`` slot per row; ``-1`` rows are skipped.
            num_scheduled_tokens: ``[num_rows]`` scheduled query length per row (tokens).
        """
        if np.count_nonzero(slots < ZERO_I64):
            keep = slots >= 0
            slots, num_scheduled_tokens = slots[keep], num_scheduled_tokens[keep]
        s, n = slots, num_scheduled_tokens
        computed, prefill_len, prefill_done = self._rows[:3]      # [max_num_reqs] each
        computed[s] += n
        if not self._prefill_left:
            return
        if not np.count_nonzero(prefill_len > prefill_done):
            self._prefill_left = False   # until the next add_request
            return  # no slot has prefill left: every row would add 0 below
        done = prefill_done[s]
        prefill_done[s] = done + np.minimum(n, np.maximum(prefill_len[s] - done, 0))  # capped

    def apply_rejected(self, slots: np.ndarray, num_rejected: np.ndarray) -> None:
        """Deferred correction on consume: ``num_computed_tokens -= rejected`` (``-1`` rows skipped)."""
        if mutants.active("no_rejected_correction"):  # model checker's mutant; never on in runs
            return
        if not np.count_nonzero(num_rejected):
            return  # nothing rejected (always without speculative decoding)
        keep = slots >= 0
        self.num_computed_tokens_np[slots[keep]] -= num_rejected[keep]

    def validate(self, device_arrays: Mapping[str, Sequence[int] | np.ndarray] | np.ndarray,
                 live_slots: np.ndarray, step: int,
                 owners: Sequence[str | None] | None = None) -> None:
        """Compare every mirror field with the device copy on the live slots.

        Args:
            device_arrays: field name -> ``[max_num_reqs]`` device values (already copied to host);
                fields absent from the mapping are not checked. Or all fields stacked in
                :data:`MIRROR_FIELDS` order, ``[len(MIRROR_FIELDS), max_num_reqs]`` (one
                comparison when they agree with the mirror on every slot).
            live_slots: ``[num_live]`` slot indices to compare.
            step: the step just finished (named in the error).
            owners: optional ``[max_num_reqs]`` req_id per slot, for the error message.

        Raises:
            MirrorDivergence: first (field, slot) whose values differ.
        """
        if isinstance(device_arrays, np.ndarray):
            if device_arrays.shape == self.values.shape and \
                    np.count_nonzero(device_arrays != self.values) == 0:
                return  # equal on every slot
            device_arrays = dict(zip(MIRROR_FIELDS, device_arrays))
        for field in MIRROR_FIELDS:
            if field not in device_arrays:
                continue
            cpu = self.array(field)[live_slots]
            dev = np.asarray(device_arrays[field])[live_slots]
            bad = np.nonzero(cpu != dev)[0]
            if bad.size:
                slot = int(live_slots[bad[0]])
                raise MirrorDivergence(
                    step=step, slot=slot, req_id=owners[slot] if owners is not None else None,
                    field=field, cpu=int(cpu[bad[0]]), device=int(dev[bad[0]]), rank=self.rank)
