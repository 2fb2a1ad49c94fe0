"""Triton body of the mirror check's fused flag (:mod:`runtime.worker.kernels.mirror_check_kernel`).

A plain function wrapped lazily by :func:`get_kernel` (``triton.jit`` or Triton's interpreter):
Triton decides interpret-vs-compile when the wrapper runs, as in ``_triton_post_update``. Reductions
call ``tl.reduce`` with the standard combine functions (``tl.max`` / ``tl.sum`` / ``tl.zeros``
are jit functions the interpreter cannot call, as in ``_triton_attention``).

One program per tile, no loop with a runtime bound (Triton 3.6's interpreter cannot take a runtime
scalar as a ``range`` bound: ``TypeError: only 0-dimensional arrays can be converted to Python
scalars``): programs ``[0, cmp_tiles)`` compare ``BLOCK`` words of the flat layout each, the
others ``ROWS`` slots of block counts and digests each, over all ``COLS`` (a power of two >=
``cols``) columns at once. A program that finds a difference stores 1 into the flag, which the
launcher zeroed just before (stores of the same value: no atomics, order-free).
"""

from __future__ import annotations

import functools

import triton.language as tl

from runtime.model.kernels._jit import kernel_wrapper


def _mirror_check_kernel(
    snap_ptr, exp_ptr, size,          # [size] int32 each: the device snapshot, the expected layout
    held_ptr, comp_ptr,               # [n] int64: num_blocks, num_computed_tokens (device)
    aux_ptr,                          # [3, n] int64: live mask, step-row mask, expected digests
    table_ptr, table_stride,          # [n, cols] int32 device block table (row stride)
    w_ptr, w0,                        # [cols] int64 digest weights W_1.., the count's weight W_0
    dig_ptr,                          # [n] int64 out: the table's digests
    flag_ptr,                         # [1] uint8 out: set to 1 when anything differs (zeroed before)
    n, cols, block_size, slack, cmp_tiles,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < cmp_tiles:                                    # BLOCK words of the flat layout
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < size
        a = tl.load(snap_ptr + offs, mask=m, other=0)
        b = tl.load(exp_ptr + offs, mask=m, other=0)
        bad = tl.reduce((a != b).to(tl.int32), 0, tl.standard._elementwise_max)
    else:                                                  # ROWS slots: block counts and digests
        rows = (pid - cmp_tiles) * ROWS + tl.arange(0, ROWS)
        rm = rows < n
        held = tl.load(held_ptr + rows, mask=rm, other=0).to(tl.int64)
        comp = tl.load(comp_ptr + rows, mask=rm, other=0).to(tl.int64)
        live = tl.load(aux_ptr + rows, mask=rm, other=0)
        step = tl.load(aux_ptr + n + rows, mask=rm, other=0)
        want = tl.load(aux_ptr + 2 * n + rows, mask=rm, other=0)
        room = held * block_size - comp
        bad_count = (live != 0) & ((room < 0) | (room >= block_size + slack))
        cs = tl.arange(0, COLS)
        cm = cs < cols
        t = tl.load(table_ptr + rows[:, None] * table_stride + cs[None, :],
                    mask=rm[:, None] & cm[None, :], other=0).to(tl.int64)
        w = tl.load(w_ptr + cs, mask=cm, other=0)
        dig = tl.reduce(t * w[None, :], 1, tl.standard._sum_combine) + held * w0   # wraps
        tl.store(dig_ptr + rows, dig, mask=rm)
        bad_dig = (dig != want) & (step != 0) & rm
        bad = tl.reduce((bad_count | bad_dig).to(tl.int32), 0, tl.standard._elementwise_max)
    tl.store(flag_ptr, bad.to(tl.uint8), mask=bad != 0)


@functools.cache
def get_kernel(interpret: bool):
    """The wrapped kernel for one mode, once per process (interpret: Triton's interpreter)."""
    return kernel_wrapper(interpret)(_mirror_check_kernel)
