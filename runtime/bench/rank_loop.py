"""The model-free loop of ``python -m runtime.bench mirror``: one rank's per-step state work
for N decode rows (block-table deltas, both post-updates, the result copy), with its mirror
validation off, on, or as at an older revision (:func:`runtime.bench.mirror.before_classes`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ppstate.batch import NewRequest, SchedulerOutput
from ppstate.block_digest import BlockDigests
from ppstate.mirror import MIRROR_FIELDS
from runtime.host_copy import HostCopy
from runtime.worker.device_state import DeviceState
from runtime.worker.mirror_check import AsyncMirrorCheck

BLOCK = 16


class RankLoop:
    """One rank's per-step state work for ``rows`` decode rows (no model)."""

    def __init__(self, rows: int, device: torch.device, prompt_len: int, max_model_len: int,
                 before: tuple[type, type] | None = None, before_deferred: bool = False) -> None:
        """``before``: :func:`before_classes` (None: no ``"before"`` mode); ``before_deferred``:
        its check takes the snapshot after the flush, as mode True does (a revision that has
        ``StageRunner.run_deferred_check``, from 43918f7 on), instead of riding on the copy."""
        self.n, self.device = rows, device
        self.state = DeviceState(rows, max_model_len, 1, device, rank=0, block_size=BLOCK)
        self.state.add_requests([NewRequest(f"r{s}", s, tuple(range(100, 100 + prompt_len)),
                                            max_model_len) for s in range(rows)])
        self.digests = BlockDigests(rows, -(-max_model_len // BLOCK))
        self.next_block = 0
        self.tokens = np.full(rows, prompt_len, dtype=np.int64)   # [rows] computed tokens
        self.held = np.zeros(rows, dtype=np.int64)                # [rows] blocks
        self.slots = np.arange(rows, dtype=np.int32)
        self.slots_t = torch.arange(rows, device=device)
        self.ones_t = torch.ones(rows, dtype=torch.int64, device=device)
        self.zeros_t = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampled = torch.full((rows, 1), 7, dtype=torch.int64, device=device)
        self.state.mirror.num_computed_tokens_np[:] = 0
        self._grow(self.tokens)                                   # the prompts' blocks
        self.state.apply_scheduled(self.slots_t, torch.full((rows,), prompt_len, device=device),
                                   self.slots.astype(np.int64), self.tokens.copy())
        cuda = device.type == "cuda"
        self.check = AsyncMirrorCheck(self.state) if cuda else None
        # mode "fused": the same check with the flag from one Triton kernel (CUDA only)
        self.fused = AsyncMirrorCheck(self.state, kernel="fused") if cuda else None
        self.before = self.before_tokens = None   # "before" blocks only
        if before is not None:
            self.before = before[0](self.state) if cuda else None
            self.before_tokens = before[1](rows, max_model_len, device)
        # the before revision's check rides on the result copy too where it can (share)
        self.before_deferred = before_deferred and self.before is not None
        self.before_rides = (self.before is not None and hasattr(self.before, "share")
                             and not self.before_deferred)
        self.token_mirror = self.state.track_tokens()   # the token-id check: "on" blocks only
        self.state.tokens = None
        self.copies = HostCopy(device)   # the last rank's result copy (every mode)
        self.held_copy = None   # the previous step's result copy, waited after the next step
        self.clock = time.perf_counter if device.type == "cuda" else time.process_time
        self.check_s = 0.0   # time spent inside the validation calls (both kinds), summed
        self.step_no = 0

    def _grow(self, need_tokens: np.ndarray) -> np.ndarray:
        """Deltas giving each slot blocks for ``need_tokens`` ``[rows]``; returns the slots."""
        need = -(-need_tokens // BLOCK)
        grow = np.flatnonzero(need > self.held)
        slots, cols = [], []
        for s in grow.tolist():
            for c in range(int(self.held[s]), int(need[s])):
                slots.append(s)
                cols.append(c)
        s_a, c_a = np.array(slots, dtype=np.int32), np.array(cols, dtype=np.int32)
        ids = np.arange(self.next_block, self.next_block + len(slots), dtype=np.int32)
        self.next_block += len(slots)
        self.held[grow] = need[grow]
        self.digests.apply([], s_a, c_a, ids)
        self.state.apply_block_updates(s_a, c_a, ids)
        return grow

    def step(self, validate: bool | str) -> None:
        """One decode step of every row (what the worker does besides the model). ``validate``:
        False, True (everything), ``"before"`` (everything, as at the before revision:
        :func:`before_classes`) or ``"counters"`` (CPU: only the mirror counters'
        check, as before issue #27: the stacked read, ``CpuMirror.validate`` and
        ``validate_blocks``) or ``"fused"`` (CUDA: everything, the check's flag from the fused
        kernel, ``--mirror-check-kernel fused``)."""
        self._grow(self.tokens + 1)
        st = self.state
        out = SchedulerOutput(self.step_no, (), self.slots, np.ones(self.n, dtype=np.int32),
                              self.tokens.astype(np.int32), np.ones(self.n, dtype=bool),
                              block_digests=self.digests.of(self.slots))
        t0 = self.clock()
        now = self._now(validate)
        if now is not None:
            now.expect_digests(out)   # compared on the device by the step's snapshot
        elif validate in (True, "before", "fused"):
            st.check_block_digests(out)
        self.check_s += self.clock() - t0
        slots64 = self.slots.astype(np.int64)
        st.apply_scheduled(self.slots_t, self.ones_t, slots64, np.ones(self.n, dtype=np.int64))
        st.apply_sampled(self.slots_t, self.sampled, self.ones_t, self.zeros_t, slots64,
                         np.zeros(self.n, dtype=np.int64), np.ones(self.n, dtype=np.int64),
                         tokens_later=self._rides(validate))
        self.tokens += 1
        t0 = self.clock()
        self.tail(validate, self.step_no)
        self.check_s += self.clock() - t0
        self.step_no += 1

    def tail(self, validate: bool | str, step: int) -> None:
        """What follows a step's post-update on the last rank: the result copy (with the
        after-step check of the ``"before"`` modes, :meth:`after_step`), the wait for the
        previous step's copy (the worker's flush, after the next step was enqueued), then the
        current check's snapshot (modes True and ``"fused"``: the untraced worker's
        ``StageRunner.run_deferred_check``, after the flush)."""
        copy = self.after_step(validate, step)
        prev, self.held_copy = self.held_copy, copy
        if prev is not None:
            prev.wait()
        now = self._now(validate)
        if now is not None:
            now.snapshot(step)

    def after_step(self, validate: bool | str, step: int):
        """The result copy and, before it, the after-step check of ``step`` in the modes that
        run it there (off: none; True / ``"fused"`` on the CPU: the synchronous check; on CUDA
        none here, :meth:`tail` runs it after the flush; ``"before"``: as at the before
        revision, riding on the result copy where it can; ``"counters"``: CPU, the mirror
        counters only); returns the copy (a PendingCopy)."""
        st = self.state
        if validate == "counters":
            live = st.live_slots()
            dev = torch.stack([getattr(st, f) for f in MIRROR_FIELDS]).cpu().numpy()
            st.mirror.validate(dev, live, step, owners=st.owner)
            st.mirror.validate_blocks(BLOCK, live, step, owners=st.owner)
        elif validate and self.check is None:
            st.validate(step)
        elif validate == "before" and self.before_rides:
            self.before.snapshot(step, later=True)
        elif validate == "before" and not self.before_deferred:   # before it rode on the copy
            self.before.snapshot(step)
        copy = self.copies.start(self.sampled)
        if self._rides(validate):   # the token mirror's ids from the result copy
            st.tokens.attach(copy.host)
            if self._now(validate) is None:   # the before revision's check rides on it
                self.before.share(copy)
        return copy

    def _now(self, validate: bool | str):
        """The current check of mode ``validate`` (True: ``graph``, ``"fused"``: the fused
        kernel's, ``"before"`` with ``before_deferred``: the before revision's), None for the
        other modes and on the CPU."""
        if validate == "before" and self.before_deferred:
            return self.before
        return self.check if validate is True else self.fused if validate == "fused" else None

    def _rides(self, validate: bool | str) -> bool:
        """Whether mode ``validate``'s token mirror takes the sampled ids from the result copy
        (the last rank's way: no own token copy; CUDA, now), and for ``"before"`` where its
        revision can, whether its check rides on that copy too (no own event)."""
        return (self._now(validate) is not None
                or (validate == "before" and self.before_rides))

    def use(self, validate: bool | str) -> None:
        """Install the token mirror of mode ``validate`` (none when off), from the device's ids."""
        st = self.state
        st.tokens = None
        if validate is True or validate == "fused":
            st.tokens = self.token_mirror
        elif validate == "before":
            if self.before_tokens is None:
                raise ValueError("RankLoop built without before classes: no 'before' mode")
            st.tokens = self.before_tokens
        if st.tokens is not None:
            st.tokens.resync(st.all_token_ids)

    def finish(self) -> None:
        """Compare what is still pending (CUDA) and wait for the last result copy."""
        for check in (self.check, self.fused, self.before):
            if check is not None:
                check.poll(block=True)
        if self.held_copy is not None:
            self.held_copy.wait()
            self.held_copy = None

    def block(self, steps: int, validate: bool | str) -> float:
        """Seconds per step of ``steps`` steps: wall time on CUDA (synchronised at the end),
        process CPU time on the CPU (the neighbours' load does not count). Also sets
        ``inside_s``: seconds per step spent inside the validation calls themselves."""
        self.check_s = 0.0
        cuda = self.device.type == "cuda"
        self.use(validate)
        clock = time.perf_counter if cuda else time.process_time
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(steps):
            self.step(validate)
        t1 = self.clock()
        self.finish()
        self.check_s += self.clock() - t1
        self.inside_s = self.check_s / steps   # the last compares included (poll)
        if cuda:
            torch.cuda.synchronize()
        return (clock() - t0) / steps
