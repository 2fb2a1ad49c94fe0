"""The mirror check's flag in one Triton kernel (``--mirror-check-kernel fused``).

:meth:`runtime.worker.check_graph.CheckGraph.enqueue` in mode ``graph`` sets the flag with
about twenty small torch kernels: the flat compare, invariant 9's block counts
(:func:`~runtime.worker.check_graph.blocks_short_or_over`), the block-table digests
(:func:`~runtime.worker.check_graph.table_digests`) and their compare, then the ``or`` of the
three. :func:`fused_check` does the same work in one program of one kernel. The check's CUDA
graph then holds the upload, the snapshot's concatenation, this kernel and the flag's copy back
(plus the token mirror's digests). The flag is the same, bit for bit. The kernel also writes the
table digests (``dig``) that :mod:`runtime.worker.mirror_naming` reads when the flag is set.

One program (grid ``(1,)``): the work is a few thousand words (``max_num_reqs`` 128: about 7k
words of flat layout and 128 block-table rows). One program needs no memset and no atomics for
the flag, and its result does not depend on scheduling. Not yet measured on the GPU
(docs/mirror_audit.md, Cost).
"""

from __future__ import annotations

import torch

from runtime.model.kernels.backend import launch_interpreted

BLOCK, ROWS, COLS = 1024, 64, 32   # words per compare tile; slots x columns per digest tile


def fused_check(snap: torch.Tensor, exp: torch.Tensor, held: torch.Tensor,
                computed: torch.Tensor, aux: torch.Tensor, table: torch.Tensor,
                weights: torch.Tensor, w0: int, dig: torch.Tensor, flag: torch.Tensor,
                block_size: int, slack: int) -> None:
    """Enqueue the check's flag: ``flag[0] = any(snap != exp) | invariant 9 broken on a live slot
    | a step row's table digest != the scheduler's``; ``dig`` gets every row's digest.

    Args:
        snap, exp: ``[size]`` int32 device snapshot and expected values (flat layout).
        held, computed: ``[n]`` int64 ``num_blocks`` and ``num_computed_tokens`` (device rows).
        aux: ``[3, n]`` int64 contiguous: live-slot mask, step-row mask, scheduler digests.
        table: ``[n, cols]`` int32 block table (last dimension contiguous).
        weights: ``[cols]`` int64 ``W_1 .. W_cols``; ``w0``: ``W_0`` as a signed int64.
        dig: ``[n]`` int64 out. flag: ``[1]`` bool or uint8 out (0/1).
        block_size, slack: invariant 9's ``0 <= held * bs - computed < bs + slack``.

    Raises:
        ValueError: shapes that do not match (checked on the host, no device sync).
    """
    n, cols = table.shape
    if snap.shape != exp.shape or aux.shape != (3, n) or weights.shape != (cols,) \
            or held.shape != (n,) or computed.shape != (n,) or dig.shape != (n,):
        raise ValueError(f"fused_check: shapes snap {tuple(snap.shape)} exp {tuple(exp.shape)} "
                         f"aux {tuple(aux.shape)} table {tuple(table.shape)} weights "
                         f"{tuple(weights.shape)} held/computed/dig {tuple(held.shape)}/"
                         f"{tuple(computed.shape)}/{tuple(dig.shape)}")
    from runtime.worker.kernels._triton_mirror_check import get_kernel
    kernel = get_kernel(launch_interpreted(snap.device))
    f8 = flag.view(torch.uint8) if flag.dtype == torch.bool else flag
    kernel[(1,)](snap, exp, snap.numel(), held, computed, aux, table, table.stride(0),
                 weights, w0, dig, f8, n, cols, block_size, slack,
                 BLOCK=BLOCK, ROWS=ROWS, COLS=COLS)
