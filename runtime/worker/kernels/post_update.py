"""Post-update of device-side per-slot state after a step, in two phases.

* :func:`post_update_computed` -- the *immediate* phase, on every rank right after its forward:
  ``num_computed_tokens[s] += q`` and ``num_computed_prefill_tokens[s] += min(q, max(prefill_len[s]
  - num_computed_prefill_tokens[s], 0))``. Same arithmetic as ``CpuMirror.apply_scheduled``.
* :func:`post_update_sampled` -- applying sampled tokens: on the last rank right after sampling,
  on earlier ranks at the deferred consume (``pp_size`` steps later, with a filtered
  ``idx_mapping``). Writes ids into ``all_token_ids``, advances ``total_len``, sets
  ``last_sampled_tokens`` and subtracts rejected speculative tokens from ``num_computed_tokens``
  (same as ``CpuMirror.apply_rejected``, i.e. for every row with a slot, sampled or not).

Rows whose ``idx_mapping`` entry is ``-1`` are skipped entirely (no read, no write): they are
filtered rows (freed or reused slots, non-final chunks). Slots of the other rows must be distinct.
Every tensor argument is modified in place; nothing is returned and nothing syncs the device
beyond what the torch fallback's boolean indexing needs.

Backends: ``"triton"`` (one program per row; compiled on CUDA, Triton's interpreter on CPU),
``"torch"`` (vectorised, masked), ``"auto"`` (the rule of
:func:`runtime.model.kernels.backend.resolve_backend`: Triton when the tensors are on CUDA and Triton
imports, or when ``PPSTATE_TRITON_INTERPRET=1`` / ``TRITON_INTERPRET=1`` is set; else torch).

Source: vLLM Model Runner V2 ``post_update`` / ``_post_update_kernel`` (PR "Avoid pipeline parallel
bubbles"), split there too into a num-computed-tokens kernel and a sampled-tokens kernel.
"""

from __future__ import annotations

import torch

from runtime.model.kernels.backend import launch_interpreted, resolve_backend


def _check(name: str, t: torch.Tensor, ndim: int, device: torch.device, rows: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (idx_mapping's device)")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, expected {rows}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:  # a size-1 dimension has no meaningful stride
        raise ValueError(f"{name} must be contiguous in its last dimension, strides {t.stride()}")


def post_update_computed(idx_mapping: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                         num_computed_tokens: torch.Tensor,
                         num_computed_prefill_tokens: torch.Tensor, prefill_len: torch.Tensor,
                         backend: str = "auto") -> None:
    """Immediate phase: advance computed-token counts by each row's query length (tokens).

    Args:
        idx_mapping: ``[R]`` int32/int64 slot per batch row; ``-1`` skips the row.
        num_scheduled_tokens: ``[R]`` int scheduled tokens per row.
        num_computed_tokens: ``[max_num_reqs]`` int32/int64, updated in place.
        num_computed_prefill_tokens: ``[max_num_reqs]`` int, updated in place.
        prefill_len: ``[max_num_reqs]`` int prompt tokens to prefill (read only).
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Raises:
        TypeError, ValueError: wrong shapes, dtypes or devices (named in the message).
    """
    dev = idx_mapping.device
    _check("idx_mapping", idx_mapping, 1, dev)
    rows = idx_mapping.shape[0]
    _check("num_scheduled_tokens", num_scheduled_tokens, 1, dev, rows)
    _check("num_computed_tokens", num_computed_tokens, 1, dev)
    m = num_computed_tokens.shape[0]
    _check("num_computed_prefill_tokens", num_computed_prefill_tokens, 1, dev, m)
    _check("prefill_len", prefill_len, 1, dev, m)
    if rows == 0:
        return
    if resolve_backend(backend, dev) == "torch":
        keep = idx_mapping >= 0
        s, n = idx_mapping[keep].long(), num_scheduled_tokens[keep].long()
        done = num_computed_prefill_tokens[s].long()
        remaining = (prefill_len[s].long() - done).clamp_min(0)
        num_computed_tokens[s] = (num_computed_tokens[s].long() + n).to(num_computed_tokens.dtype)
        num_computed_prefill_tokens[s] = (done + torch.minimum(n, remaining)).to(
            num_computed_prefill_tokens.dtype)
        return
    from runtime.worker.kernels._triton_post_update import get_kernels
    kernel = get_kernels(launch_interpreted(dev)).computed
    kernel[(rows,)](idx_mapping, num_scheduled_tokens, num_computed_tokens,
                    num_computed_prefill_tokens, prefill_len)


def post_update_sampled(idx_mapping: torch.Tensor, sampled_token_ids: torch.Tensor,
                        num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                        last_sampled_tokens: torch.Tensor, all_token_ids: torch.Tensor,
                        total_len: torch.Tensor, num_computed_tokens: torch.Tensor,
                        backend: str = "auto") -> None:
    """Apply one step's sampled tokens to the slots of its rows.

    For each row r with slot ``s = idx_mapping[r] >= 0`` and ``n = num_sampled[r]``:
    ``num_computed_tokens[s] -= num_rejected[r]``; and if ``n > 0``:
    ``all_token_ids[s, total_len[s] + i] = sampled_token_ids[r, i]`` for ``i < n`` and positions
    ``< max_model_len``; ``total_len[s] = min(total_len[s] + n, max_model_len)``;
    ``last_sampled_tokens[s, :] = sampled_token_ids[r, :]`` (the id the next decode step feeds is
    column ``n - 1``; later columns are padding).

    Args:
        idx_mapping: ``[R]`` int32/int64 slot per row; ``-1`` skips the row.
        sampled_token_ids: ``[R, width]`` int64 (``width`` = 1 + speculative tokens).
        num_sampled: ``[R]`` int32 valid ids per row (0 for non-final chunks).
        num_rejected: ``[R]`` int32 rejected speculative tokens per row.
        last_sampled_tokens: ``[max_num_reqs, width]`` int64, updated in place.
        all_token_ids: ``[max_num_reqs, max_model_len]`` int32/int64 prompt + output ids.
        total_len: ``[max_num_reqs]`` int tokens held in ``all_token_ids``, updated in place.
        num_computed_tokens: ``[max_num_reqs]`` int, updated in place.
        backend: ``"auto"`` | ``"triton"`` | ``"torch"``.

    Raises:
        TypeError, ValueError: wrong shapes, dtypes or devices, or ``width`` mismatch.
    """
    dev = idx_mapping.device
    _check("idx_mapping", idx_mapping, 1, dev)
    rows = idx_mapping.shape[0]
    _check("sampled_token_ids", sampled_token_ids, 2, dev, rows)
    _check("num_sampled", num_sampled, 1, dev, rows)
    _check("num_rejected", num_rejected, 1, dev, rows)
    _check("last_sampled_tokens", last_sampled_tokens, 2, dev)
    m, width = last_sampled_tokens.shape
    if sampled_token_ids.shape[1] != width:
        raise ValueError(f"sampled_token_ids width {sampled_token_ids.shape[1]} != "
                         f"last_sampled_tokens width {width}")
    _check("all_token_ids", all_token_ids, 2, dev, m)
    _check("total_len", total_len, 1, dev, m)
    _check("num_computed_tokens", num_computed_tokens, 1, dev, m)
    max_model_len = all_token_ids.shape[1]
    if rows == 0:
        return
    if resolve_backend(backend, dev) == "torch":
        _sampled_torch(idx_mapping, sampled_token_ids, num_sampled, num_rejected,
                       last_sampled_tokens, all_token_ids, total_len, num_computed_tokens)
        return
    from runtime.worker.kernels._triton_post_update import block_for, get_kernels
    kernel = get_kernels(launch_interpreted(dev)).sampled
    kernel[(rows,)](idx_mapping, sampled_token_ids, sampled_token_ids.stride(0), num_sampled,
                    num_rejected, last_sampled_tokens, last_sampled_tokens.stride(0),
                    all_token_ids, all_token_ids.stride(0), total_len, num_computed_tokens,
                    max_model_len, WIDTH=width, BLOCK=block_for(width))


def _sampled_torch(idx_mapping, sampled_token_ids, num_sampled, num_rejected,
                   last_sampled_tokens, all_token_ids, total_len, num_computed_tokens) -> None:
    """Vectorised fallback of :func:`post_update_sampled` (same contract)."""
    rows = torch.nonzero(idx_mapping >= 0).squeeze(1)
    s = idx_mapping[rows].long()
    num_computed_tokens[s] = (num_computed_tokens[s].long() - num_rejected[rows].long()).to(
        num_computed_tokens.dtype)
    n = num_sampled[rows].long()
    has = n > 0
    rows, s, n = rows[has], s[has], n[has]
    ids = sampled_token_ids[rows]                                          # [K, width]
    width, max_model_len = ids.shape[1], all_token_ids.shape[1]
    start = total_len[s].long()                                            # [K]
    cols = torch.arange(width, device=ids.device)
    pos = start[:, None] + cols[None, :]                                   # [K, width]
    write = (cols[None, :] < n[:, None]) & (pos < max_model_len)
    all_token_ids[s[:, None].expand_as(pos)[write], pos[write]] = ids[write].to(all_token_ids.dtype)
    total_len[s] = torch.clamp(start + n, max=max_model_len).to(total_len.dtype)
    last_sampled_tokens[s] = ids.to(last_sampled_tokens.dtype)
