"""The mirror check's flag in one Triton kernel (``--mirror-check-kernel fused``).

:meth:`runtime.worker.check_graph.CheckGraph.enqueue` in mode ``graph`` sets the flag with
about twenty small torch kernels: the flat compare, invariant 9's block counts
(:func:`~runtime.worker.check_graph.blocks_short_or_over`), the block-table digests
(:func:`~runtime.worker.check_graph.table_digests`) and their compare, then the ``or`` of the
three. :func:`fused_check` does the same work in one program of one kernel. The check's CUDA
graph then holds the upload, the snapshot's concatenation, this kernel and the flag's copy back
(plus the token mirror's digests). The flag is the same, bit for bit. The kernel also writes the
table digests (``dig``) that :mod:`runtime.worker.mirror_naming` reads when the flag is set.

A grid over tiles: ``ceil(size / BLOCK)`` programs compare the flat layout, ``ceil(n / ROWS)``
programs the slots' block counts and digests, all columns of a row in one tile (``COLS``: the
next power of two >= ``cols``; ``ROWS`` shrinks as ``COLS`` grows so that a tile stays about
4096 ids). The flag is zeroed first (one memset, in the same stream) and a program that finds a
difference stores 1 (the same value from any program: no atomics). Until 2026-12-03 (third
session) the kernel ran as one program looping over everything, which made it slower than the
torch kernels at 256 slots (docs/mirror_audit.md, Cost).
"""

from __future__ import annotations

import torch

from runtime.model.kernels.backend import launch_interpreted

BLOCK, TILE_IDS = 2048, 4096   # words per compare tile; about the ids per digest tile


def tile_shape(cols: int) -> tuple[int, int]:
    """``(ROWS, COLS)`` of a digest tile for a table of ``cols`` columns: ``COLS`` the next power
    of two >= ``cols``, ``ROWS`` a power of two in ``[1, 64]`` with ``ROWS * COLS <= TILE_IDS``
    where possible."""
    c = 1 << max(0, cols - 1).bit_length()
    return max(1, min(64, TILE_IDS // c)), c


def fused_check(snap: torch.Tensor, exp: torch.Tensor, held: torch.Tensor,
                computed: torch.Tensor, aux: torch.Tensor, table: torch.Tensor,
                weights: torch.Tensor, w0: int, dig: torch.Tensor, flag: torch.Tensor,
                block_size: int, slack: int) -> None:
    """Enqueue the check's flag: ``flag[0] = any(snap != exp) | invariant 9 broken on a live slot
    | a step row's table digest != the scheduler's``; ``dig`` gets every row's digest (a zeroing
    of ``flag``, then one kernel over ``ceil(size / BLOCK) + ceil(n / ROWS)`` programs).

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
    f8.zero_()
    rows, c = tile_shape(cols)
    cmp_tiles = -(-snap.numel() // BLOCK)
    grid = (cmp_tiles + -(-n // rows),)
    kernel[grid](snap, exp, snap.numel(), held, computed, aux, table, table.stride(0),
                 weights, w0, dig, f8, n, cols, block_size, slack, cmp_tiles,
                 BLOCK=BLOCK, ROWS=rows, COLS=c)
