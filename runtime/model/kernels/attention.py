"""Attention over the paged KV cache: a KV write through ``slot_mapping`` and one varlen
attention kernel for decode, prefill and mixed rows (Triton; torch reference on CPU).

Layout (shared with the paged KV cache, see ``docs/gpu.md``): one layer's cache is
``k_cache, v_cache [num_blocks, block_size, KVH, D]``; a token's flat index is
``block_id * block_size + offset``. Per step: ``block_tables [R, MB]`` int32 (row r's block ids),
``seq_lens [R]`` int32 (keys of row r after this step), ``query_start_loc [R + 1]`` int32
(row r's queries are tokens ``[qsl[r], qsl[r+1])`` of the flat batch).

Causality: query i of row r sits at absolute position ``seq_lens[r] - query_len_r + i`` and attends
keys ``0 ..`` that position (its cached prefix plus the causal part of its own chunk). GQA: query
head h reads KV head ``h // (H // KVH)``; K/V are never repeated. Decode rows (``query_len`` 1) with
long contexts use split-K (``num_splits`` > 1), merged by a second kernel.

Backends: ``"triton"`` (compiled on CUDA; Triton's interpreter for CPU tensors),
``"torch"`` (:mod:`runtime.model.kernels.attention_ref`, row by row), ``"auto"`` (as
:func:`runtime.model.kernels.backend.resolve_backend`: Triton on CUDA, or on CPU under
``TRITON_INTERPRET=1`` / ``PPSTATE_TRITON_INTERPRET=1``; else torch).
"""

from __future__ import annotations

import torch

from runtime.model.kernels.attention_ref import paged_attention_ref, write_kv_ref
from runtime.model.kernels.backend import launch_interpreted, resolve_backend

#: Split-K partitions chosen for a decode step: enough (row, KV head) programs to fill the GPU.
TARGET_PROGRAMS = 264  # 2 per SM of an H100 / H200 (132 SMs)
MIN_KEYS_PER_SPLIT = 256


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, backend: str = "auto") -> None:
    """Store this step's keys/values in the cache (in place).

    Args:
        k, v: ``[T, KVH, D]`` (inner two dims contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]`` contiguous, same dtype as k/v.
        slot_mapping: ``[T]`` int64 flat token index; ``-1`` rows are not written.
    Raises:
        ValueError: shape / dtype mismatch (named in the message).
    """
    t = k.shape[0]
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache "
                         f"{tuple(k_cache.shape)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if t == 0:
        return
    if resolve_backend(backend, k.device) == "torch":
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    from runtime.model.kernels._triton_attention import get_kernels
    row = k.shape[1] * k.shape[2]
    get_kernels(launch_interpreted(k.device)).write_kv[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=_pow2(row))


def choose_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split-K partitions for a decode step: 1 unless ``rows * KVH`` programs leave the GPU idle
    and the context is long enough to share (>= ``2 * MIN_KEYS_PER_SPLIT`` keys); at most 16."""
    programs = max(num_rows * num_kv_heads, 1)
    if programs >= TARGET_PROGRAMS or max_seq_len < 2 * MIN_KEYS_PER_SPLIT:
        return 1
    return int(min(16, TARGET_PROGRAMS // programs, max_seq_len // MIN_KEYS_PER_SPLIT))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    num_splits: int = 1, out: torch.Tensor | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """Causal varlen GQA attention of ``q`` over the paged cache.

    Args:
        q: ``[T, H, D]`` rotated queries (inner two dims contiguous), T = ``query_start_loc[-1]``.
        k_cache, v_cache: ``[num_blocks, block_size, KVH, D]``, written for every key a row reads.
        block_tables: ``[R, MB]`` int32; seq_lens: ``[R]`` int32; query_start_loc: ``[R + 1]`` int32.
        max_query_len: largest ``query_len`` of the step (Python int; sets the grid, so a CUDA graph of
            decode steps uses 1). Larger than the truth is allowed (idle programs exit).
        scale: softmax scale, usually ``D ** -0.5``.
        num_splits: split-K partitions of each row's keys (decode; see :func:`choose_num_splits`).
        out: optional ``[T, H, D]`` output buffer (static buffers of CUDA graphs).
    Returns:
        ``[T, H, D]`` in q's dtype; rows with ``seq_len`` 0 (graph padding) give zeros.
    Raises:
        ValueError: H not a multiple of KVH, or mismatched shapes.
    """
    t, h, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    if h % kvh or k_cache.shape[3] != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    rows = seq_lens.shape[0]
    if query_start_loc.shape != (rows + 1,) or block_tables.shape[0] != rows:
        raise ValueError(f"seq_lens [{rows}] needs query_start_loc [{rows + 1}] and block_tables "
                         f"[{rows}, MB]; got {tuple(query_start_loc.shape)}, {tuple(block_tables.shape)}")
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or rows == 0:
        return out
    if resolve_backend(backend, q.device) == "torch":
        out.copy_(paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens,
                                      query_start_loc, scale))
        return out
    from runtime.model.kernels._triton_attention import get_kernels
    kern = get_kernels(launch_interpreted(q.device))
    group = h // kvh
    block_q = 1 if max_query_len <= 1 else max(1, 64 // _pow2(group))
    block_m = max(16, _pow2(block_q * group))
    n_qtiles = -(-max(int(max_query_len), 1) // block_q)
    splits = max(int(num_splits), 1)
    grid = (rows, kvh, n_qtiles * splits)
    meta = dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)),
                BLOCK_SIZE=bs, BLOCK_N=64 if block_m <= 64 else 32, NUM_SPLITS=splits)
    ks, vs = k_cache.stride(), v_cache.stride()
    common = (block_tables, seq_lens, query_start_loc, scale, q.stride(0), q.stride(1),
              ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
    if splits == 1:
        kern.attention[grid](q, k_cache, v_cache, out, out, out, *common,
                             out.stride(0), out.stride(1), block_tables.stride(0), **meta)
        return out
    part = torch.empty(t, h, splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    kern.attention[grid](q, k_cache, v_cache, part, m, l, *common, 0, 0,
                         block_tables.stride(0), **meta)
    kern.combine[(t, h)](part, m, l, out, out.stride(0), out.stride(1), NUM_HEADS=h,
                         NUM_SPLITS=splits, BLOCK_S=max(2, _pow2(splits)), HEAD_DIM=d,
                         BLOCK_D=_pow2(d))
    return out
