"""Per-slot device state checked beyond the CPU mirror's counters (docs/mirror_audit.md).

:class:`~ppstate.mirror.CpuMirror` covers the counters (``MIRROR_FIELDS``). A step also reads,
per slot, the block-table row, ``total_len`` (the sampled ids' end: penalties' history, the
next input position) and the sampling parameter tables. Each has an exact host copy written
from the same inputs as the device tensor (scheduler deltas, admissions, the sampled counts):

* ``block_table`` ``[max_num_reqs, cols]`` int32 vs ``DeviceState.block_table_np``;
* ``total_len`` ``[max_num_reqs]`` int64 vs ``DeviceState.total_len_np``;
* ``sampling.f32`` ``[max_num_reqs, 5]`` fp32 (compared bit for bit) and ``sampling.i64``
  ``[max_num_reqs, 4]`` int64 vs ``SamplingState.f32_np`` / ``i64_np``;
* ``logit_bias.ids`` ``[max_num_reqs, W]`` int64 and ``logit_bias.values`` ``[max_num_reqs, W]``
  fp32 vs ``LogitBiasTable.ids_np`` / ``values_np``, on the live slots that hold a bias (the only
  rows the sampler gathers; ``W`` = 300), appended to the flat layout only when there are some.

The mirrored counters (``MIRROR_FIELDS``) and ``total_len`` are rows of one device buffer
(``DeviceState.fields`` ``[F + 1, max_num_reqs]``). On the CPU the tensors are host memory and
:func:`check_now` compares them in place with the host copies, one byte comparison per table (the
block table: one element-wise test of the columns in use) and no device copy. Otherwise
everything travels as one flat int32 tensor (int64 values as pairs of int32
words, fp32 values as their bits), so the asynchronous check
(:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`) adds one concatenation and one
device-to-host copy per step, and the synchronous one one read: counters ``[2 * F * n]``,
``total_len`` ``[2 * n]``, ``sampling.i64`` ``[8 * n]``, ``block_table`` ``[n * k]``,
``sampling.f32`` ``[5 * n]``, then with ``b`` biased live slots ``logit_bias.ids`` ``[2 * W * b]``
and ``logit_bias.values`` ``[W * b]`` (``n = max_num_reqs``; ``k``: the table's columns in use, the most
blocks a live slot holds, :func:`used_cols`; no step reads a column past its slot's count).
:func:`compare` tests everything with one equality and only when it fails looks at the live slots
field by field and names the first divergent (field, slot).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ppstate.errors import MirrorDivergence
from ppstate.mirror import MIRROR_FIELDS

F32_NAMES = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
I64_NAMES = ("top_k", "seed", "has_seed", "prompt_len")
F = len(MIRROR_FIELDS)


def bias_width(state) -> int:
    """Entries per slot of the logit-bias tables (``W``)."""
    return state.sampling_state.logit_bias.width


def flat_size(n: int, k: int, b: int = 0, w: int = 0) -> int:
    """int32 words of the flat layout for ``n`` slots, ``k`` block-table columns and ``b`` biased
    live slots of ``w`` logit-bias entries each."""
    return 2 * F * n + 2 * n + 2 * 4 * n + n * k + 5 * n + 3 * w * b


def used_cols(state, live: np.ndarray) -> int:
    """Block-table columns in use: the most blocks a ``live`` slot holds (host mirror), >= 1."""
    return max(1, int(state.mirror.num_blocks_np[live].max())) if live.size else 1


def biased(state, live: np.ndarray) -> np.ndarray:
    """``[B]`` live slots holding a logit bias (compared in the flat layout's last segments)."""
    return state.sampling_state.logit_bias.biased_live(live)


def bind_host_layout(state) -> np.ndarray:
    """Move ``state``'s host copies into one ``[flat_size(n, cols)]`` int32 array laid out as
    the flat layout over every block-table column, and return it: ``mirror.values``,
    ``total_len_np``, ``sampling_state.i64_np``, ``block_table_np`` and ``sampling_state.f32_np``
    (its bits) become views of it (their values kept), so the asynchronous check copies the
    whole expected layout with one ``np.copyto`` per step (the writers update them in place)."""
    n, k = state.block_table_np.shape
    flat = np.zeros(flat_size(n, k), dtype=np.int32)
    counters, t, i64, bt, f32, _, _ = unpack(flat, n, k)
    ss = state.sampling_state
    state.mirror.rebind(counters)
    for name, obj, view in (("total_len_np", state, t), ("i64_np", ss, i64),
                            ("block_table_np", state, bt),
                            ("f32_np", ss, f32.view(np.float32))):
        np.copyto(view, getattr(obj, name))
        setattr(obj, name, view)
    return flat


def device_parts(state, k: int, biased_t: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The device tensors of the flat layout, each as flat int32 (``biased_t``: ``[B]`` slots on
    the device whose logit-bias rows are appended)."""
    ss = state.sampling_state
    parts = [state.fields.view(-1).view(torch.int32), ss.i64.reshape(-1).view(torch.int32),
             state.block_table[:, :k].reshape(-1), ss.f32.reshape(-1).view(torch.int32)]
    if biased_t is not None and biased_t.numel():
        lb = ss.logit_bias
        parts += [lb.ids.index_select(0, biased_t).view(torch.int32).reshape(-1),
                  lb.values.index_select(0, biased_t).view(torch.int32).reshape(-1)]
    return parts


def device_flat(state, k: int, biased_t: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``[flat_size(n, k, b, W)]`` int32: ``state``'s device tensors in the flat layout (a new
    tensor, or ``out``: their values once the kernels enqueued before it have run)."""
    parts = device_parts(state, k, biased_t)
    return torch.cat(parts) if out is None else torch.cat(parts, out=out)


def host_flat(state, k: int, out: np.ndarray | None = None,
              biased_slots: np.ndarray | None = None) -> np.ndarray:
    """The host copies in the flat layout (written into ``out``, ``[flat_size(n, k, b, W)]``
    int32, if given; ``biased_slots``: ``[B]`` slots whose logit-bias rows are appended)."""
    n = state.block_table_np.shape[0]
    b = 0 if biased_slots is None else biased_slots.size
    w = bias_width(state)
    if out is None:
        out = np.empty(flat_size(n, k, b, w), dtype=np.int32)
    fill_host(state, k, unpack(out, n, k, b, w), biased_slots)
    return out


def fill_host(state, k: int, views: tuple[np.ndarray, ...],
              biased_slots: np.ndarray | None = None) -> None:
    """Write the host copies into ``views`` (:func:`unpack` of a flat layout with ``k``
    block-table columns and ``biased_slots``' logit-bias rows; a caller may keep the views of a
    buffer it reuses: five copies, no new array)."""
    counters, t, i64, bt, f32, lb_ids, lb_vals = views
    b = 0 if biased_slots is None else biased_slots.size
    counters[:] = state.mirror.values
    t[:] = state.total_len_np
    i64[:] = state.sampling_state.i64_np
    bt[:] = state.block_table_np[:, :k]
    f32[:] = state.sampling_state.f32_np.view(np.int32)
    if b:
        lb = state.sampling_state.logit_bias
        np.take(lb.ids_np, biased_slots, axis=0, out=lb_ids)
        np.take(lb.values_np.view(np.int32), biased_slots, axis=0, out=lb_vals)


def unpack(flat: np.ndarray, n: int, k: int, b: int = 0, w: int = 0) -> tuple[np.ndarray, ...]:
    """Views of ``flat``: counters ``[F, n]`` int64 (``MIRROR_FIELDS`` order), ``total_len``
    ``[n]`` int64, ``sampling.i64`` ``[n, 4]`` int64, ``block_table`` ``[n, k]`` int32,
    ``sampling.f32`` bits ``[n, 5]`` int32, ``logit_bias.ids`` ``[b, w]`` int64 and
    ``logit_bias.values`` bits ``[b, w]`` int32 (of the biased live slots, in order)."""
    z = 2 * F * n
    a, bb, c = z + 2 * n, z + 10 * n, z + 10 * n + n * k
    d = c + 5 * n
    return (flat[:z].view(np.int64).reshape(F, n), flat[z:a].view(np.int64),
            flat[a:bb].view(np.int64).reshape(n, 4), flat[bb:c].reshape(n, k),
            flat[c:d].reshape(n, 5), flat[d:d + 2 * w * b].view(np.int64).reshape(b, w),
            flat[d + 2 * w * b:d + 3 * w * b].reshape(b, w))


def check_now(state, live: np.ndarray, step: int) -> None:
    """The synchronous check of everything but the counters (``CpuMirror.validate`` names
    those): on the CPU the device tensors are compared in place (one equality per table, over
    every slot; the logit-bias tables on the biased live slots); on another device, or when one
    differs, through the flat copy and :func:`compare` (which looks at the live slots only).

    Raises:
        MirrorDivergence: as :func:`compare`.
    """
    n, k = state.block_table_np.shape[0], used_cols(state, live)
    bl = biased(state, live)
    if state.device.type == "cpu":
        ss = state.sampling_state
        lb = ss.logit_bias
        if (same(state.total_len.numpy(), state.total_len_np) and same(ss.i64.numpy(), ss.i64_np)
                and same(ss.f32.numpy(), ss.f32_np)
                and not np.count_nonzero(state.block_table.numpy()[:, :k] !=
                                         state.block_table_np[:, :k])   # columns in use
                and (not bl.size or (same(lb.ids.numpy()[bl], lb.ids_np[bl])
                                     and same(lb.values.numpy()[bl], lb.values_np[bl])))):
            return
    bl_t = torch.as_tensor(bl).to(state.device) if bl.size else None
    compare(device_flat(state, k, bl_t).cpu().numpy(), host_flat(state, k, biased_slots=bl), n, k,
            live, step, state.rank, state.owner, bl, bias_width(state))


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype) hold the same bytes (fp32: bit for bit):
    one copy and one ``memcmp`` each, cheaper than numpy's element-wise equality at these sizes."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(dev: np.ndarray, exp: np.ndarray, n: int, cols: int, live: np.ndarray, step: int,
            rank: int | None, owners: Sequence[str | None] | None,
            biased_slots: np.ndarray | None = None, w: int = 0) -> None:
    """Compare the device values ``dev`` with the host copies ``exp`` (both flat
    ``[flat_size(n, cols, b, w)]`` int32) on the ``live`` slots (the logit-bias segments: on
    ``biased_slots``, ``[b]``).

    Raises:
        MirrorDivergence: the first divergent field and slot; ``cpu`` / ``device`` are the host
            and device values (an fp32 field's bits as int32).
    """
    if same(dev, exp):
        return
    bl = live[:0] if biased_slots is None else biased_slots
    b = bl.size
    names = (("total_len",), tuple(f"sampling.{x}" for x in I64_NAMES),
             tuple(f"block_table[{c}]" for c in range(cols)),
             tuple(f"sampling.{x}" for x in F32_NAMES),
             tuple(f"logit_bias.ids[{c}]" for c in range(w)),
             tuple(f"logit_bias.values[{c}]" for c in range(w)))
    d_all, e_all = unpack(dev, n, cols, b, w), unpack(exp, n, cols, b, w)
    d0, e0 = d_all[0][:, live], e_all[0][:, live]   # counters [F, num_live], named by field row
    if not np.array_equal(d0, e0):
        f, i = (int(x) for x in np.argwhere(d0 != e0)[0])
        _raise(step, rank, owners, int(live[i]), MIRROR_FIELDS[f], e0[f, i], d0[f, i])
    for j, (d, e, fields) in enumerate(zip(d_all[1:], e_all[1:], names)):
        rows = live if j < 4 else bl
        if j < 4:
            d, e = d[live], e[live]
        if np.array_equal(d, e):
            continue
        bad = np.argwhere(d != e)[0]
        i, c = int(bad[0]), int(bad[1]) if bad.size > 1 else 0
        _raise(step, rank, owners, int(rows[i]), fields[c], e[(i, c)[:d.ndim]],
               d[(i, c)[:d.ndim]])


def _raise(step: int, rank: int | None, owners, slot: int, field: str, cpu, device) -> None:
    raise MirrorDivergence(step=step, slot=slot, field=field, cpu=int(cpu), device=int(device),
                           req_id=owners[slot] if owners is not None else None, rank=rank)
