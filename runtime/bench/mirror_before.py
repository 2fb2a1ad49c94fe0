"""The after-step check as it was before it moved onto the device, kept to measure against in one
run (``python -m runtime.bench mirror`` alternates off, on and this, reported as ``before_*``).

Same coverage and the same host / device work as that check on its fast path (everything equal):

* before the forward: the block-id digests of the step's rows (``DeviceState.check_block_digests``,
  unchanged since);
* after the step, CUDA: one concatenation of the device tables copied to pinned host memory (one
  non-blocking copy), an event, the host copies written in the same flat layout, and the previous
  step's snapshot compared on the host when the next one starts (blocking on its event): one byte
  comparison of the two flat arrays and the vectorised block-count test;
* after the step, CPU: ``DeviceState.validate`` without the token ids (in place).
"""

from __future__ import annotations

import numpy as np
import torch

from ppstate.errors import MirrorDivergence
from ppstate.mirror import MIRROR_FIELDS
from runtime.worker import state_check


class BeforeCheck:
    """The host-compare check of one rank's ``state`` (a
    :class:`~runtime.worker.device_state.DeviceState`)."""

    def __init__(self, state) -> None:
        self.state = state
        n, cols = state.block_table_np.shape
        pin = state.device.type == "cuda"
        size = state_check.flat_size(n, cols)
        self.host_flat = [torch.empty(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.expected_flat = [np.empty(size, dtype=np.int32) for _ in range(2)]
        self.pending: list[tuple] = []

    def digests(self, out) -> None:
        """Before the forward: the rows' digests against the scheduler's."""
        self.state.check_block_digests(out)

    def after_step(self, step: int) -> None:
        """After the step's post-update: the synchronous check (CPU) or the async snapshot."""
        st = self.state
        if st.device.type != "cuda":
            tokens, st.tokens = st.tokens, None   # the token ids were not checked before
            try:
                st.validate(step)
            finally:
                st.tokens = tokens
            return
        self.finish()
        live = st.live_slots()
        n, k = st.block_table_np.shape[0], state_check.used_cols(st, live)
        b, size = step % 2, state_check.flat_size(n, k)
        self.host_flat[b][:size].copy_(state_check.device_flat(st, k), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        state_check.host_flat(st, k, self.expected_flat[b][:size])
        self.pending.append((b, live, event, size, k))

    def finish(self) -> None:
        """Compare the pending snapshot (blocking on its copy)."""
        nb, nct = MIRROR_FIELDS.index("num_blocks"), MIRROR_FIELDS.index("num_computed_tokens")
        while self.pending:
            b, live, event, size, k = self.pending.pop(0)
            event.synchronize()
            n = self.state.block_table_np.shape[0]
            dev, exp = self.host_flat[b][:size].numpy(), self.expected_flat[b][:size]
            counters = state_check.unpack(exp, n, k)[0]
            bs = self.state.block_size
            held, computed = counters[nb, live], counters[nct, live]
            if not (state_check.same(dev, exp) and (held >= -(-computed // bs)).all()
                    and (held <= -(-computed // bs)).all()):
                raise MirrorDivergence(step=-1, slot=-1, field="state", req_id=None, cpu=0,
                                       device=0, rank=self.state.rank)
