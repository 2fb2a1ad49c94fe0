"""Triton bodies of the fused elementwise kernels (contract in :mod:`runtime.model.kernels.fused`).

Each replays the rounding steps of the torch expressions it replaces (``runtime.model.layers``),
so results match them to the last bit except where an fp32 reduction order differs (the mean of
squares): every intermediate that torch stores in the model dtype is rounded to it here too
(``.to(dtype)``), and arithmetic runs in fp32 as torch's elementwise kernels do. One program per
token row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import triton
import triton.language as tl

from runtime.model.kernels._jit import kernel_wrapper


def _add_rms_norm_kernel(
    x_ptr, res_ptr,            # [T, N] input and residual (residual may equal x: HAS_RES False)
    w_ptr,                     # [N] norm weight
    out_ptr, res_out_ptr,      # [T, N] normed output, updated residual (x + residual)
    eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + t * N + offs, mask=m, other=0.0)
    dt = x.dtype
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + t * N + offs, mask=m, other=0.0).to(tl.float32)).to(dt)
    tl.store(res_out_ptr + t * N + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / N
    normed = (xf * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + t * N + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(dt), mask=m)


def _rope_write_kv_kernel(
    qkv_ptr,                   # [T, (H + 2 KVH) * D] fused projection output
    cos_ptr, sin_ptr,          # [max_len, D / 2] tables (model dtype)
    pos_ptr,                   # [T] int64 positions
    slot_ptr,                  # [T] int64 flat KV index, -1 = no write
    q_out_ptr,                 # [T, H, D] rotated queries
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, KVH, D]
    qn_ptr, kn_ptr,            # [D] per-head q / k RMSNorm weights (HAS_NORM; else unused)
    eps,
    H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    D = 2 * HALF
    W = (H + 2 * KVH) * D
    pos = tl.load(pos_ptr + t)
    hh = tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_HALF)
    dm = dd < HALF
    c = tl.load(cos_ptr + pos * HALF + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * HALF + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
    row = qkv_ptr + t * W
    # queries: heads [0, H)
    qm = (hh[:, None] < H) & dm[None, :]
    qa = row + hh[:, None] * D + dd[None, :]
    x1 = tl.load(qa, mask=qm, other=0.0)
    x2 = tl.load(qa + HALF, mask=qm, other=0.0)
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:  # per-head RMSNorm, rounded as layers.rms_norm: w * (x * rsqrt(var + eps)).to(dt)
        ss = (tl.reduce(f1 * f1, 1, tl.standard._sum_combine)
              + tl.reduce(f2 * f2, 1, tl.standard._sum_combine))
        r = tl.rsqrt(ss / D + eps)[:, None]
        w1 = tl.load(qn_ptr + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(qn_ptr + HALF + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
        f1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        f2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    o1 = ((f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)).to(dt)
    qo = q_out_ptr + t * H * D + hh[:, None] * D + dd[None, :]
    tl.store(qo, o1, mask=qm)
    tl.store(qo + HALF, o2, mask=qm)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        km = (hh[:, None] < KVH) & dm[None, :]
        ka = row + H * D + hh[:, None] * D + dd[None, :]
        k1 = tl.load(ka, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(ka + HALF, mask=km, other=0.0).to(tl.float32)
        if HAS_NORM:
            ss = (tl.reduce(k1 * k1, 1, tl.standard._sum_combine)
                  + tl.reduce(k2 * k2, 1, tl.standard._sum_combine))
            r = tl.rsqrt(ss / D + eps)[:, None]
            w1 = tl.load(kn_ptr + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(kn_ptr + HALF + dd, mask=dm, other=0.0).to(tl.float32)[None, :]
            k1 = (w1 * (k1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            k2 = (w2 * (k2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        r1 = ((k1 * c).to(dt).to(tl.float32) - (k2 * s).to(dt).to(tl.float32)).to(dt)
        r2 = ((k2 * c).to(dt).to(tl.float32) + (k1 * s).to(dt).to(tl.float32)).to(dt)
        ko = k_cache_ptr + slot * KVH * D + hh[:, None] * D + dd[None, :]
        tl.store(ko, r1, mask=km)
        tl.store(ko + HALF, r2, mask=km)
        va = ka + KVH * D
        vo = v_cache_ptr + slot * KVH * D + hh[:, None] * D + dd[None, :]
        tl.store(vo, tl.load(va, mask=km, other=0.0), mask=km)
        tl.store(vo + HALF, tl.load(va + HALF, mask=km, other=0.0), mask=km)


def _silu_mul_kernel(
    gu_ptr,                    # [T, 2 I] gate | up
    out_ptr,                   # [T, I]
    I: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = tl.load(gu_ptr + t * 2 * I + offs, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * 2 * I + I + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + t * I + offs, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


class Kernels(NamedTuple):
    """Launchable fused kernels of one mode."""
    add_rms_norm: Callable
    rope_write_kv: Callable
    silu_mul: Callable


@functools.cache
def get_kernels(interpret: bool) -> Kernels:
    """Wrap the bodies once per process and mode (interpreter for CPU tensors)."""
    wrap = kernel_wrapper(interpret)
    return Kernels(wrap(_add_rms_norm_kernel), wrap(_rope_write_kv_kernel), wrap(_silu_mul_kernel))
