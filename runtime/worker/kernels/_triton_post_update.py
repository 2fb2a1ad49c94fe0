"""Triton kernels of the post-update (one program per batch row; ``-1`` rows do nothing).

The kernel bodies are plain functions; :func:`get_kernels` wraps them on first use, either with
``triton.jit`` (compiled, CUDA tensors) or with Triton's interpreter (CPU tensors, or
``TRITON_INTERPRET=1``). Wrapping lazily matters: Triton decides interpret-vs-compile when the
decorator runs, so a module-level ``@triton.jit`` would freeze the choice at import time.

Source: vLLM Model Runner V2 ``input_batch.py`` ``_post_update_kernel`` /
``_post_update_num_computed_tokens_kernel`` (PR "Avoid pipeline parallel bubbles"), where filtered
rows carry ``idx_mapping == -1`` and must not touch any slot (a negative slot would otherwise write
before the start of the buffer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import triton
import triton.language as tl

from runtime.model.kernels._jit import kernel_wrapper


def _post_update_computed_kernel(
    idx_mapping_ptr,                   # [R] int32/int64 slot per row, -1 = skip
    num_scheduled_tokens_ptr,                    # [R] int scheduled tokens per row
    num_computed_tokens_ptr,           # [max_num_reqs]
    num_computed_prefill_tokens_ptr,   # [max_num_reqs]
    prefill_len_ptr,                   # [max_num_reqs]
):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    if slot >= 0:
        n = tl.load(num_scheduled_tokens_ptr + row)
        computed = tl.load(num_computed_tokens_ptr + slot)
        tl.store(num_computed_tokens_ptr + slot, computed + n)
        done = tl.load(num_computed_prefill_tokens_ptr + slot)
        remaining = tl.maximum(tl.load(prefill_len_ptr + slot) - done, 0)
        tl.store(num_computed_prefill_tokens_ptr + slot, done + tl.minimum(n, remaining))


def _post_update_sampled_kernel(
    idx_mapping_ptr,            # [R] int32/int64 slot per row, -1 = skip
    sampled_ptr,                # [R, WIDTH] int64
    sampled_stride,
    num_sampled_ptr,            # [R] int
    num_rejected_ptr,           # [R] int
    last_sampled_ptr,           # [max_num_reqs, WIDTH] int64
    last_sampled_stride,
    all_token_ids_ptr,          # [max_num_reqs, max_model_len]
    all_token_ids_stride,
    total_len_ptr,              # [max_num_reqs]
    num_computed_tokens_ptr,    # [max_num_reqs]
    max_model_len,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    if slot >= 0:
        # Deferred correction: rejected speculative tokens were counted by the immediate phase.
        rejected = tl.load(num_rejected_ptr + row)
        computed = tl.load(num_computed_tokens_ptr + slot)
        tl.store(num_computed_tokens_ptr + slot, computed - rejected)
        n = tl.load(num_sampled_ptr + row)
        if n > 0:
            offs = tl.arange(0, BLOCK)
            in_row = offs < WIDTH
            ids = tl.load(sampled_ptr + row.to(tl.int64) * sampled_stride + offs, mask=in_row,
                          other=0)
            start = tl.load(total_len_ptr + slot)
            pos = start + offs
            tl.store(all_token_ids_ptr + slot * all_token_ids_stride + pos, ids,
                     mask=(offs < n) & (pos < max_model_len))
            tl.store(total_len_ptr + slot, tl.minimum(start + n, max_model_len))
            tl.store(last_sampled_ptr + slot * last_sampled_stride + offs, ids, mask=in_row)


class Kernels(NamedTuple):
    """The two launchable kernels (``kernel[(R,)](...)``) of one mode."""
    computed: Callable
    sampled: Callable


@functools.cache
def get_kernels(interpret: bool) -> Kernels:
    """Wrap the kernel bodies for one mode, once per process.

    Args:
        interpret: True -> Triton's interpreter (runs on CPU tensors, slow, for tests);
            False -> ``triton.jit`` (compiled for CUDA; still interpreted when the process has
            ``TRITON_INTERPRET=1``, since ``triton.jit`` honours it).
    """
    wrap = kernel_wrapper(interpret)
    return Kernels(wrap(_post_update_computed_kernel), wrap(_post_update_sampled_kernel))


def block_for(width: int) -> int:
    """Power-of-two ``tl.arange`` extent covering ``width`` columns."""
    return triton.next_power_of_2(max(int(width), 1))
