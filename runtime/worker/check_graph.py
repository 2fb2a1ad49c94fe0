"""The device side of the asynchronous mirror check: its buffers and its work, one CUDA graph per
double buffer (:class:`~runtime.worker.mirror_check.AsyncMirrorCheck` drives it).

Buffer ``k`` (``k`` = step mod 2) of the expected values, pinned on the host and on the device,
is laid out as int32 words:

* ``[0, 6n)``: three int64 rows ``[3, n]`` (``n = max_num_reqs``): the live-slot mask (0/1),
  the mask of the step's rows (0/1), and the scheduler's block-id digest of each such row
  (:attr:`~ppstate.batch.SchedulerOutput.block_digests`, scattered by slot);
* ``[6n, 6n + size)``: the host copies in the flat layout of :mod:`runtime.worker.state_check`.

The device work of buffer ``k``, in stream order after the step (:meth:`CheckGraph.enqueue`):

1. one copy of the buffer's ``6n + size`` words to the device;
2. the step's snapshot: the device tables concatenated in the flat layout (``snap_dev[k]``);
3. one flag (``flag_host[k]``, one byte back to pinned memory), set when the snapshot differs
   from the expected values, when a live slot's block count breaks invariant 9
   (:func:`blocks_short_or_over`), or when a step row's block-table digest, computed on the
   device from the device table (:func:`table_digests`, into ``dig_dev[k]``), differs from the
   scheduler's (``kernel="fused"``, ``--mirror-check-kernel fused``: all of 3 in one Triton
   kernel, :mod:`runtime.worker.kernels.mirror_check_kernel`, same flag and digests);
4. with a token mirror, the ``all_token_ids`` rows' digests, copied back (``tok_host[k]``).

Without logit-bias rows and over every block-table column this is captured once per buffer as
a CUDA graph (:meth:`CheckGraph.graph`): the host's per-step device work is one launch.

The device digest equals the host digest of ``ppstate.block_digest.row_digests`` whenever the
device table and block counts equal the host's, which the same flag tests (the block table
over all its columns in the graph's layout), so together they check what the host digest before
the forward checked: a table whose two copies both hold ids the scheduler did not decide
(``test_both_copies_wrong_caught_by_the_schedulers_digest``), caught after the step instead of
before its forward, still within the step.
"""

from __future__ import annotations

import numpy as np
import torch

from ppstate.block_digest import column_weights
from ppstate.mirror import MIRROR_FIELDS
from runtime.host_copy import to_device
from runtime.worker import state_check
from runtime.worker.kernels.mirror_check_kernel import fused_check

AUX_ROWS = 3   # int64 rows before the flat layout: live mask, step-row mask, expected digests
KERNELS = ("graph", "fused")   # how the flag is computed (--mirror-check-kernel)


class CheckGraph:
    """Double-buffered expected values, snapshots and flags of one rank's check.

    Args:
        state: the rank's DeviceState (``fields``, ``block_table`` ``[n, cols]``,
            ``block_size``, ``width``, ``tokens``, ``all_token_ids``).
        kernel: ``"graph"``: the flag from about twenty torch kernels; ``"fused"``: from one
            Triton kernel (:func:`~runtime.worker.kernels.mirror_check_kernel.fused_check`),
            the same flag and digests.

    Attributes:
        exp_np: ``[2, 6n + capacity]`` int32 pinned expected values (numpy view).
        aux_np: per buffer ``[3, n]`` int64 views of its first ``6n`` words; ``aux_rows``: the
            same as three ``[n]`` row views.
        flag_np: ``[2]`` bool, each buffer's flag once landed.
        tok_np: ``[2, n]`` int64 token-row digests once landed.
    """

    def __init__(self, state, kernel: str = "graph") -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.state, self.kernel = state, kernel
        self.n = n = state.block_table_np.shape[0]
        self.cols = state.block_table_np.shape[1]
        self.head = 2 * AUX_ROWS * n                  # int32 words before the flat layout
        self._pin = pin = state.device.type == "cuda"
        dev = state.device
        self.capacity = 0
        self.graphs: list | None = None
        self.use_graphs = pin
        self.grow(state_check.flat_size(n, self.cols))   # the most columns
        self.flag_host = torch.zeros(2, dtype=torch.bool, pin_memory=pin)   # [2] per buffer
        self.flag_np = self.flag_host.numpy()
        self.flag_dev = torch.zeros(2, dtype=torch.bool, device=dev)     # fused: the kernel's
        self.tok_dev = torch.zeros(2, n, dtype=torch.int64, device=dev)
        self.tok_host = torch.zeros(2, n, dtype=torch.int64, pin_memory=pin)
        self.tok_np = self.tok_host.numpy()
        self.dig_dev = torch.zeros(2, n, dtype=torch.int64, device=dev)    # the table's digests
        w = column_weights(self.cols + 1).view(np.int64)
        self.dig_w = torch.from_numpy(w[1:].copy()).to(dev)                 # [cols]
        self.dig_w0 = int(w[0])
        self._nct = MIRROR_FIELDS.index("num_computed_tokens")
        self._nb = MIRROR_FIELDS.index("num_blocks")

    def grow(self, size: int) -> None:
        """Buffers for a flat layout of ``size`` int32 words (only while nothing is pending);
        recaptures the graphs when they grow."""
        if size <= self.capacity:
            return
        dev, words = self.state.device, self.head + size + (size & 1)   # even: int64 views
        self.capacity, self.graphs = size, None   # the graphs read the old buffers
        self.exp_host = torch.zeros(2, words, dtype=torch.int32, pin_memory=self._pin)
        self.exp_np = self.exp_host.numpy()
        self.aux_np = [self.exp_np[k, :self.head].view(np.int64).reshape(AUX_ROWS, self.n)
                       for k in range(2)]
        self.aux_rows = [tuple(a) for a in self.aux_np]   # (live, rows, digests) [n] views
        self.exp_dev = torch.zeros(2, words, dtype=torch.int32, device=dev)
        self.snap_dev = torch.empty(2, size, dtype=torch.int32, device=dev)

    def expected(self, k: int, size: int) -> np.ndarray:
        """``[size]`` int32: buffer ``k``'s flat layout (after its three int64 rows)."""
        return self.exp_np[k, self.head:self.head + size]

    def enqueue(self, k: int, size: int, cols: int, bl: np.ndarray) -> None:
        """Buffer ``k``'s device work (stream order, module docstring) for a flat layout of
        ``size`` words with ``cols`` block-table columns and the biased slots ``bl``."""
        st, n = self.state, self.n
        exp_d = self.exp_dev[k, :self.head + size]
        exp_d.copy_(self.exp_host[k, :self.head + size], non_blocking=True)
        aux = exp_d[:self.head].view(torch.int64).view(AUX_ROWS, n)
        snap = self.snap_dev[k, :size]
        state_check.device_flat(st, cols, to_device(bl, st.device) if bl.size else None, out=snap)
        if self.kernel == "fused":
            fused_check(snap, exp_d[self.head:], st.fields[self._nb], st.fields[self._nct], aux,
                        st.block_table, self.dig_w, self.dig_w0, self.dig_dev[k],
                        self.flag_dev[k:k + 1], st.block_size, 2 * (st.width - 1))
            self.flag_host[k:k + 1].copy_(self.flag_dev[k:k + 1], non_blocking=True)
        else:
            self._torch_flag(k, snap, exp_d, aux)
        if st.tokens is not None:   # compared on the host when the sampled ids have landed too
            st.tokens.device_digest(st.all_token_ids, self.tok_dev[k])
            self.tok_host[k].copy_(self.tok_dev[k], non_blocking=True)

    def _torch_flag(self, k: int, snap: torch.Tensor, exp_d: torch.Tensor,
                    aux: torch.Tensor) -> None:
        """Mode ``graph``: buffer ``k``'s flag (and digests) from torch kernels."""
        st = self.state
        torch.add(table_digests(st.block_table, self.dig_w), st.fields[self._nb],
                  alpha=self.dig_w0, out=self.dig_dev[k])
        bad = blocks_short_or_over(st.fields[self._nb], st.fields[self._nct], st.block_size,
                                   2 * (st.width - 1), aux[0] != 0)
        bad_digest = ((self.dig_dev[k] != aux[2]) & (aux[1] != 0)).any()
        flag = torch.ne(snap, exp_d[self.head:]).any() | bad | bad_digest
        self.flag_host[k:k + 1].copy_(flag.view(1), non_blocking=True)

    def graph(self, k: int):
        """Buffer ``k``'s device work over every block-table column and no logit-bias rows,
        captured once as a CUDA graph; None when capture fails (then :attr:`use_graphs` turns
        off and the work is enqueued op by op)."""
        if self.graphs is None:
            size = state_check.flat_size(self.n, self.cols)
            none = np.zeros(0, dtype=np.int64)
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):            # warm-up outside the capture
                    for b in range(2):
                        self.enqueue(b, size, self.cols, none)
                torch.cuda.current_stream().wait_stream(side)
                graphs = []
                for b in range(2):   # thread_local: other threads' CUDA calls stay legal
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, capture_error_mode="thread_local"):
                        self.enqueue(b, size, self.cols, none)
                    graphs.append(g)
                torch.cuda.synchronize()
                self.graphs = graphs
            except Exception:   # capture not supported here: op by op from now on
                self.use_graphs, self.graphs = False, None
                torch.cuda.synchronize()
                return None
        return self.graphs[k]


def table_digests(table: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[n]`` int64 ``sum_c table[s, c] * W_{c+1}`` (wrapping mod 2**64) of a ``[n, cols]`` block
    table (``weights``: ``[cols]`` int64 ``W_1 .. W_cols``); with ``num_blocks * W_0`` added it
    is ``row_digests`` of every row (columns past a row's count hold 0 on a healthy rank)."""
    return (table.to(torch.int64) * weights).sum(dim=1)


def blocks_short_or_over(held: torch.Tensor, computed: torch.Tensor, block_size: int, slack: int,
                         live: torch.Tensor) -> torch.Tensor:
    """Invariant 9 on the device: whether a ``live`` slot holds fewer blocks than its computed
    tokens need, or more than they need with ``slack`` draft tokens (``held``, ``computed``,
    ``live``: ``[max_num_reqs]``; ``ceil(c / bs) <= h <= ceil((c + slack) / bs)`` is ``0 <= h * bs
    - c < bs + slack``). Returns a 0-d bool tensor (enqueued, no host wait)."""
    room = held * block_size - computed                                   # [max_num_reqs]
    return torch.logical_and(live, (room < 0) | (room >= block_size + slack)).any()
