"""Triton body of the mirror check's fused flag (:mod:`runtime.worker.kernels.mirror_check_kernel`).

A plain function wrapped lazily by :func:`get_kernel` (``triton.jit`` or Triton's interpreter):
Triton decides interpret-vs-compile when the wrapper runs, as in ``_triton_post_update``. Reductions
call ``tl.reduce`` with the standard combine functions (``tl.max`` / ``tl.sum`` / ``tl.zeros``
are jit functions the interpreter cannot call, as in ``_triton_attention``).
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
    flag_ptr,                         # [1] uint8 out: 1 when anything differs
    n, cols, block_size, slack,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):
    bad = tl.full([BLOCK], 0, tl.int32)
    for start in range(0, size, BLOCK):                    # the flat layout, word by word
        offs = start + tl.arange(0, BLOCK)
        m = offs < size
        a = tl.load(snap_ptr + offs, mask=m, other=0)
        b = tl.load(exp_ptr + offs, mask=m, other=0)
        bad = bad | (a != b).to(tl.int32)
    for r0 in range(0, n, ROWS):                           # per slot: block counts and digests
        rows = r0 + tl.arange(0, ROWS)
        rm = rows < n
        held = tl.load(held_ptr + rows, mask=rm, other=0).to(tl.int64)
        comp = tl.load(comp_ptr + rows, mask=rm, other=0).to(tl.int64)
        live = tl.load(aux_ptr + rows, mask=rm, other=0)
        step = tl.load(aux_ptr + n + rows, mask=rm, other=0)
        want = tl.load(aux_ptr + 2 * n + rows, mask=rm, other=0)
        room = held * block_size - comp
        bad_count = (live != 0) & ((room < 0) | (room >= block_size + slack))
        acc = tl.full([ROWS], 0, tl.int64)
        for c0 in range(0, cols, COLS):
            cs = c0 + tl.arange(0, COLS)
            cm = cs < cols
            t = tl.load(table_ptr + rows[:, None] * table_stride + cs[None, :],
                        mask=rm[:, None] & cm[None, :], other=0).to(tl.int64)
            w = tl.load(w_ptr + cs, mask=cm, other=0)
            acc = acc + tl.reduce(t * w[None, :], 1, tl.standard._sum_combine)
        dig = acc + held * w0                              # wraps mod 2**64 like torch
        tl.store(dig_ptr + rows, dig, mask=rm)
        bad_dig = (dig != want) & (step != 0) & rm
        bad = bad | tl.reduce((bad_count | bad_dig).to(tl.int32), 0,
                               tl.standard._elementwise_max)
    tl.store(flag_ptr, tl.reduce(bad, 0, tl.standard._elementwise_max).to(tl.uint8))


@functools.cache
def get_kernel(interpret: bool):
    """The wrapped kernel for one mode, once per process (interpret: Triton's interpreter)."""
    return kernel_wrapper(interpret)(_mirror_check_kernel)
