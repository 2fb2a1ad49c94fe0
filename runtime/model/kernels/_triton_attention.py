"""Triton kernel bodies of the paged attention (see :mod:`runtime.model.kernels.attention` for the
contract).

Three kernels:

* ``_write_kv_kernel`` -- one program per token: copies that token's ``[KVH, D]`` key and value rows
  into the cache at the flat index ``slot_mapping[t]`` (block_id * block_size + offset); ``-1`` skips.
* ``_paged_attn_kernel`` -- one program per (batch row, KV head, query tile [, KV split]). The
  program packs the ``GROUP`` query heads that share the KV head with ``BLOCK_Q`` query tokens
  into one ``[BLOCK_M, D]`` tile (GQA without repeating K/V: each key tile is loaded once for all
  of them), walks the row's keys in tiles of ``BLOCK_N`` through the block table (each key's
  block looked up individually, so a tile may span several cache blocks) and keeps an online
  softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). Causal: query i of a row
  with ``query_len`` queries and ``seq_len`` keys sits at position ``seq_len - query_len + i``.
* ``_combine_splits_kernel`` -- split-K (FlashDecoding, Dao et al. 2023): with ``NUM_SPLITS > 1``
  the attention kernel writes each split's unnormalised partial output with its running max and
  sum; this kernel merges them, one program per (token, head).

Reductions call ``tl.reduce`` with the standard combine functions rather than ``tl.max`` /
``tl.sum``: those are themselves jit functions, which Triton's interpreter (used here without
``TRITON_INTERPRET=1``) cannot call. Bodies are plain functions wrapped lazily by :func:`get_kernels` (``triton.jit`` or the
interpreter), like ``_triton_post_update``. Source of the tiling: vLLM's Triton "unified attention"
kernel (``triton_unified_attention.py``) packs GQA heads and query tokens the same way; the code
here is written from that description.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import triton
import triton.language as tl

from runtime.model.kernels._jit import kernel_wrapper


def _write_kv_kernel(
    k_ptr, v_ptr,                      # [T, KVH, D] (row stride given; inner dims contiguous)
    k_cache_ptr, v_cache_ptr,          # [num_blocks * block_size, KVH, D] contiguous view
    slot_mapping_ptr,                  # [T] int64, -1 = skip
    stride_kt, stride_vt,
    ROW: tl.constexpr,                 # KVH * D
    BLOCK: tl.constexpr,               # next power of two >= ROW
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        m = offs < ROW
        k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=m)
        v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=m)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=m)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=m)


def _paged_attn_kernel(
    q_ptr,                             # [T, H, D]
    k_cache_ptr, v_cache_ptr,          # [num_blocks, BLOCK_SIZE, KVH, D]
    out_ptr,                           # [T, H, D] (NUM_SPLITS == 1) or partials [T, H, S, D]
    m_ptr, l_ptr,                      # [T, H, S] fp32 running max / sum (NUM_SPLITS > 1)
    block_tables_ptr,                  # [R, MB] int32
    seq_lens_ptr,                      # [R] int32
    query_start_loc_ptr,               # [R + 1] int32
    scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr,               # H // KVH
    BLOCK_Q: tl.constexpr,             # query tokens per program
    BLOCK_M: tl.constexpr,             # >= BLOCK_Q * GROUP, power of two, >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,             # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,          # KV cache block size (tokens)
    BLOCK_N: tl.constexpr,             # keys per tile
    NUM_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    pid2 = tl.program_id(2)
    qtile = pid2 // NUM_SPLITS
    split = pid2 % NUM_SPLITS
    q_start = tl.load(query_start_loc_ptr + row)
    query_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if qtile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + row)
        ctx = seq_len - query_len
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_idx = qtile * BLOCK_Q + offs_m // GROUP              # query token within the row
        head = kvh * GROUP + offs_m % GROUP
        m_valid = (q_idx < query_len) & (offs_m < BLOCK_Q * GROUP)
        d_valid = offs_d < HEAD_DIM
        tok = (q_start + q_idx).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        q_pos = ctx + q_idx                                     # absolute position of each query
        # keys this tile of queries can see, then this split's share (whole key tiles)
        kv_end = tl.minimum(ctx + (qtile + 1) * BLOCK_Q, seq_len)
        per_split = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
            within = offs_n % BLOCK_SIZE
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + within[:, None] * stride_ks
                        + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + within[:, None] * stride_vs
                        + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale                  # [BLOCK_M, BLOCK_N] fp32
            allowed = n_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing seen yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out_mask = m_valid[:, None] & d_valid[None, :]
        if NUM_SPLITS == 1:
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)             # padding rows (seq_len 0): zeros
            o = acc / l_safe[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            th = (tok * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split   # [T, H, S] index
            tl.store(out_ptr + th[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
            tl.store(m_ptr + th, m_i, mask=m_valid)
            tl.store(l_ptr + th, l_i, mask=m_valid)


def _combine_splits_kernel(
    part_ptr,                          # [T, H, S, D] fp32 unnormalised partial outputs
    m_ptr, l_ptr,                      # [T, H, S] fp32
    out_ptr,                           # [T, H, D]
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < NUM_SPLITS
    base = (t * NUM_HEADS + h) * NUM_SPLITS
    m = tl.load(m_ptr + base + offs_s, mask=s_valid, other=float("-inf"))
    l = tl.load(l_ptr + base + offs_s, mask=s_valid, other=0.0)
    m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_valid, tl.exp(m - m_max), 0.0)               # empty splits: exp(-inf) = 0
    denom = tl.reduce(w * l, 0, tl.standard._sum_combine)
    denom = tl.where(denom == 0.0, 1.0, denom)
    part = tl.load(part_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.reduce(part * w[:, None], 0, tl.standard._sum_combine) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


class Kernels(NamedTuple):
    """Launchable kernels of one mode (``kernel[grid](...)``)."""
    write_kv: Callable
    attention: Callable
    combine: Callable


@functools.cache
def get_kernels(interpret: bool) -> Kernels:
    """Wrap the kernel bodies once per process and mode (interpreter for CPU tensors)."""
    wrap = kernel_wrapper(interpret)
    return Kernels(wrap(_write_kv_kernel), wrap(_paged_attn_kernel), wrap(_combine_splits_kernel))
