"""The per-step validation work as issue #27 first landed it, kept to measure against in one run.

``python -m runtime.bench mirror`` alternates off, on (the current check) and this replica, so the
saving is measured under the same load. Same coverage and the same host / device work as the
#27 code on its fast path (everything equal): no error naming, which only runs on a divergence.

* before the forward: the block-id digests of the step's rows, every product widened to uint64
  (``table[slots, :k].astype(uint64) * W``, summed per row);
* after the step, CPU: ``torch.stack`` of the five mirrored device tensors, ``CpuMirror.validate``
  and ``validate_blocks``, a ``torch.cat`` of ``total_len``, the sampling tables and the used
  block-table columns, the same host layout written, one equality;
* after the step, CUDA: the stack and the concatenation each copied to pinned host memory
  (two copies), an event, the host copies written (``np.stack`` of the mirror, the flat layout),
  and the previous step's snapshot compared when the next one starts (blocking on its event).
"""

from __future__ import annotations

import numpy as np
import torch

from ppstate.block_digest import column_weights
from ppstate.errors import MirrorDivergence
from ppstate.mirror import MIRROR_FIELDS
from runtime.worker import state_check


def row_digests_before(table: np.ndarray, num_blocks: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``[num_rows]`` int64 digests, computed as #27 did (uint64 products)."""
    s = slots.astype(np.int64)
    nb = num_blocks[s]
    k = int(nb.max()) if nb.size else 0
    w = column_weights(k + 1)
    d = nb.astype(np.uint64) * w[0]
    if k:
        d += (table[s, :k].astype(np.uint64) * w[1:]).sum(axis=1, dtype=np.uint64)
    return d.view(np.int64)


def _flat_size(n: int, k: int) -> int:
    return 2 * n + 8 * n + n * k + 5 * n


def _device_flat(state, k: int) -> torch.Tensor:
    ss = state.sampling_state
    return torch.cat([state.total_len.view(torch.int32), ss.i64.reshape(-1).view(torch.int32),
                      state.block_table[:, :k].reshape(-1), ss.f32.reshape(-1).view(torch.int32)])


def _host_flat(state, k: int, out: np.ndarray) -> np.ndarray:
    n = state.block_table_np.shape[0]
    a, b, c = 2 * n, 10 * n, 10 * n + n * k
    out[:a].view(np.int64)[:] = state.total_len_np
    out[a:b].view(np.int64).reshape(n, 4)[:] = state.sampling_state.i64_np
    out[b:c].reshape(n, k)[:] = state.block_table_np[:, :k]
    out[c:c + 5 * n].reshape(n, 5)[:] = state.sampling_state.f32_np.view(np.int32)
    return out


class BeforeCheck:
    """The #27 check of one rank's ``state`` (a :class:`~runtime.worker.device_state.DeviceState`)."""

    def __init__(self, state) -> None:
        self.state = state
        n, cols = state.block_table_np.shape
        f, pin = len(MIRROR_FIELDS), state.device.type == "cuda"
        self.host = [torch.empty(f, n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.expected = [np.empty((f, n), dtype=np.int64) for _ in range(2)]
        self.host_flat = [torch.empty(_flat_size(n, cols), dtype=torch.int32, pin_memory=pin)
                          for _ in range(2)]
        self.expected_flat = [np.empty(_flat_size(n, cols), dtype=np.int32) for _ in range(2)]
        self.pending: list[tuple] = []

    def digests(self, out) -> None:
        """Before the forward: the rows' digests against the scheduler's."""
        st = self.state
        got = row_digests_before(st.block_table_np, st.mirror.num_blocks_np, out.slots)
        if np.flatnonzero(got != out.block_digests).size:
            raise MirrorDivergence(step=out.step, slot=-1, field="block_ids (digest vs scheduler)",
                                   req_id=None, cpu=0, device=0, rank=st.rank)

    def after_step(self, step: int) -> None:
        """After the step's post-update: the synchronous check (CPU) or the async snapshot."""
        st = self.state
        live = st.live_slots()
        n, k = st.block_table_np.shape[0], state_check.used_cols(st, live)
        if st.device.type != "cuda":
            dev = torch.stack([getattr(st, f) for f in MIRROR_FIELDS]).cpu().numpy()
            st.mirror.validate(dev, live, step, owners=st.owner)
            st.mirror.validate_blocks(st.block_size, live, step, owners=st.owner)
            flat = _host_flat(st, k, self.expected_flat[0][:_flat_size(n, k)])
            if not np.array_equal(_device_flat(st, k).cpu().numpy(), flat):
                raise MirrorDivergence(step=step, slot=-1, field="state", req_id=None, cpu=0,
                                       device=0, rank=st.rank)
            return
        self.finish()
        b, size = step % 2, _flat_size(n, k)
        self.host[b].copy_(torch.stack([getattr(st, f) for f in MIRROR_FIELDS]), non_blocking=True)
        self.host_flat[b][:size].copy_(_device_flat(st, k), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        np.stack([st.mirror.array(f) for f in MIRROR_FIELDS], out=self.expected[b])
        _host_flat(st, k, self.expected_flat[b][:size])
        self.pending.append((b, live, list(st.owner), event, size))

    def finish(self) -> None:
        """Compare the pending snapshot (blocking on its copy)."""
        while self.pending:
            b, live, _, event, size = self.pending.pop(0)
            event.synchronize()
            e, dev = self.expected[b][:, live], self.host[b].numpy()
            bs = self.state.block_size
            held, computed = e[MIRROR_FIELDS.index("num_blocks")], e[0]
            ok = (np.array_equal(e, dev[:, live]) and (held >= -(-computed // bs)).all()
                  and (held <= -(-computed // bs)).all()
                  and np.array_equal(self.host_flat[b][:size].numpy(), self.expected_flat[b][:size]))
            if not ok:
                raise MirrorDivergence(step=-1, slot=-1, field="state", req_id=None, cpu=0,
                                       device=0, rank=self.state.rank)
