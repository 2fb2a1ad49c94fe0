"""Per-slot device state checked beyond the CPU mirror's counters (docs/mirror_audit.md).

:class:`~ppstate.mirror.CpuMirror` covers the counters (``MIRROR_FIELDS``). A step also reads,
per slot, the block-table row, ``total_len`` (the sampled ids' end: penalties' history, the
next input position) and the sampling parameter tables. Each has an exact host copy written
from the same inputs as the device tensor (scheduler deltas, admissions, the sampled counts):

* ``block_table`` ``[max_num_reqs, cols]`` int32 vs ``DeviceState.block_table_np``;
* ``total_len`` ``[max_num_reqs]`` int64 vs ``DeviceState.total_len_np``;
* ``sampling.f32`` ``[max_num_reqs, 5]`` fp32 (compared bit for bit) and ``sampling.i64``
  ``[max_num_reqs, 4]`` int64 vs ``SamplingState.f32_np`` / ``i64_np``.

The mirrored counters (``MIRROR_FIELDS``) and ``total_len`` are rows of one device buffer
(``DeviceState.fields`` ``[F + 1, max_num_reqs]``). On the CPU the tensors are host memory and
:func:`check_now` compares them in place with the host copies, one byte comparison per table (the
block table: one element-wise test of the columns in use) and no device copy. Otherwise
everything travels as one flat int32 tensor (int64 values as pairs of int32
words, fp32 values as their bits), so the asynchronous check
(:class:`~runtime.worker.mirror_check.AsyncMirrorCheck`) adds one concatenation and one
device-to-host copy per step, and the synchronous one one read: counters ``[2 * F * n]``,
``total_len`` ``[2 * n]``, ``sampling.i64`` ``[8 * n]``, ``block_table`` ``[n * k]``,
``sampling.f32`` ``[5 * n]`` (``n = max_num_reqs``; ``k``: the table's columns in use, the most
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


def flat_size(n: int, k: int) -> int:
    """int32 words of the flat layout for ``n`` slots and ``k`` block-table columns."""
    return 2 * F * n + 2 * n + 2 * 4 * n + n * k + 5 * n


def used_cols(state, live: np.ndarray) -> int:
    """Block-table columns in use: the most blocks a ``live`` slot holds (host mirror), >= 1."""
    return max(1, int(state.mirror.num_blocks_np[live].max())) if live.size else 1


def device_flat(state, k: int) -> torch.Tensor:
    """``[flat_size(n, k)]`` int32: ``state``'s device tensors in the flat layout (a new tensor:
    their values once the kernels enqueued before it have run)."""
    ss = state.sampling_state
    return torch.cat([state.fields.view(-1).view(torch.int32), ss.i64.reshape(-1).view(torch.int32),
                      state.block_table[:, :k].reshape(-1), ss.f32.reshape(-1).view(torch.int32)])


def host_flat(state, k: int, out: np.ndarray | None = None) -> np.ndarray:
    """The host copies in the flat layout (written into ``out``, ``[flat_size(n, k)]`` int32,
    if given)."""
    n = state.block_table_np.shape[0]
    if out is None:
        out = np.empty(flat_size(n, k), dtype=np.int32)
    counters, t, i64, bt, f32 = unpack(out, n, k)
    counters[:] = state.mirror.values
    t[:] = state.total_len_np
    i64[:] = state.sampling_state.i64_np
    bt[:] = state.block_table_np[:, :k]
    f32[:] = state.sampling_state.f32_np.view(np.int32)
    return out


def unpack(flat: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Views of ``flat``: counters ``[F, n]`` int64 (``MIRROR_FIELDS`` order), ``total_len``
    ``[n]`` int64, ``sampling.i64`` ``[n, 4]`` int64, ``block_table`` ``[n, k]`` int32,
    ``sampling.f32`` bits ``[n, 5]`` int32."""
    z = 2 * F * n
    a, b, c = z + 2 * n, z + 10 * n, z + 10 * n + n * k
    return (flat[:z].view(np.int64).reshape(F, n), flat[z:a].view(np.int64),
            flat[a:b].view(np.int64).reshape(n, 4), flat[b:c].reshape(n, k),
            flat[c:c + 5 * n].reshape(n, 5))


def check_now(state, live: np.ndarray, step: int) -> None:
    """The synchronous check of everything but the counters (``CpuMirror.validate`` names
    those): on the CPU the device tensors are compared in place (one equality per table, over
    every slot); on another device, or when one differs, through the flat copy and
    :func:`compare` (which looks at the live slots only).

    Raises:
        MirrorDivergence: as :func:`compare`.
    """
    n, k = state.block_table_np.shape[0], used_cols(state, live)
    if state.device.type == "cpu":
        ss = state.sampling_state
        if (same(state.total_len.numpy(), state.total_len_np) and same(ss.i64.numpy(), ss.i64_np)
                and same(ss.f32.numpy(), ss.f32_np)
                and not np.count_nonzero(state.block_table.numpy()[:, :k] !=
                                         state.block_table_np[:, :k])):   # columns in use
            return
    compare(device_flat(state, k).cpu().numpy(), host_flat(state, k), n, k, live, step,
            state.rank, state.owner)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype) hold the same bytes (fp32: bit for bit):
    one copy and one ``memcmp`` each, cheaper than numpy's element-wise equality at these sizes."""
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(dev: np.ndarray, exp: np.ndarray, n: int, cols: int, live: np.ndarray, step: int,
            rank: int | None, owners: Sequence[str | None] | None) -> None:
    """Compare the device values ``dev`` with the host copies ``exp`` (both flat
    ``[flat_size(n, cols)]`` int32) on the ``live`` slots.

    Raises:
        MirrorDivergence: the first divergent field and slot; ``cpu`` / ``device`` are the host
            and device values (an fp32 field's bits as int32).
    """
    if same(dev, exp):
        return
    names = (("total_len",), tuple(f"sampling.{x}" for x in I64_NAMES),
             tuple(f"block_table[{c}]" for c in range(cols)),
             tuple(f"sampling.{x}" for x in F32_NAMES))
    d_all, e_all = unpack(dev, n, cols), unpack(exp, n, cols)
    d0, e0 = d_all[0][:, live], e_all[0][:, live]   # counters [F, num_live], named by field row
    if not np.array_equal(d0, e0):
        f, i = (int(x) for x in np.argwhere(d0 != e0)[0])
        _raise(step, rank, owners, int(live[i]), MIRROR_FIELDS[f], e0[f, i], d0[f, i])
    for d, e, fields in zip(d_all[1:], e_all[1:], names):
        d, e = d[live], e[live]
        if np.array_equal(d, e):
            continue
        bad = np.argwhere(d != e)[0]
        i, c = int(bad[0]), int(bad[1]) if bad.size > 1 else 0
        slot = live[i]
        _raise(step, rank, owners, int(slot), fields[c], e[(i, c)[:d.ndim]], d[(i, c)[:d.ndim]])


def _raise(step: int, rank: int | None, owners, slot: int, field: str, cpu, device) -> None:
    raise MirrorDivergence(step=step, slot=slot, field=field, cpu=int(cpu), device=int(device),
                           req_id=owners[slot] if owners is not None else None, rank=rank)
