"""Naming the divergence behind a set flag of the asynchronous mirror check (the slow path).

:class:`~runtime.worker.mirror_check.AsyncMirrorCheck` learns from one byte that buffer ``k``'s
snapshot differs from its expected values (:mod:`runtime.worker.check_graph`). Only then does
:func:`name_divergence` copy the snapshot and the step rows' table digests back and look, in the
order the synchronous check would report them: field by field over the live slots
(``state_check.compare``), then the block counts (invariant 9, as
``CpuMirror.validate_blocks`` names them), then the block-id digests against the scheduler's.
"""

from __future__ import annotations

import numpy as np

from ppstate.errors import MirrorDivergence
from ppstate.mirror import MIRROR_FIELDS, CpuMirror
from runtime.worker import state_check

_NCT = MIRROR_FIELDS.index("num_computed_tokens")
_NB = MIRROR_FIELDS.index("num_blocks")


def name_divergence(state, dev, p) -> None:
    """Raise the first divergence of pending snapshot ``p`` (``p.buf``, ``p.size``, ``p.cols``,
    ``p.live``, ``p.step``, ``p.owners``, ``p.biased``) of ``dev`` (a
    :class:`~runtime.worker.check_graph.CheckGraph`). Returns when there is none to report (a
    set flag from a slot that is neither live nor a step row).

    Raises:
        MirrorDivergence: naming rank, step, slot, request, field and both values.
    """
    n, rank = dev.n, state.mirror.rank
    exp_flat = dev.expected(p.buf, p.size)
    state_check.compare(dev.snap_dev[p.buf, :p.size].cpu().numpy(), exp_flat, n, p.cols, p.live,
                        p.step, rank, p.owners, p.biased, state_check.bias_width(state))
    exp = state_check.unpack(exp_flat, n, p.cols)[0]                  # [F, max_num_reqs]
    bs, slack = state.block_size, 2 * (state.width - 1)   # spec drafts' blocks
    held, computed = exp[_NB, p.live], exp[_NCT, p.live]   # [num_live] each
    if not ((held >= -(-computed // bs)).all() and (held <= -(-(computed + slack) // bs)).all()):
        _raise_blocks(state, p, exp)
    _raise_digest(dev, p, rank)


def _raise_blocks(state, p, exp: np.ndarray) -> None:
    """The first slot of ``p`` whose block count breaks invariant 9, as
    ``CpuMirror.validate_blocks`` names it (``exp``: the counters ``[F, max_num_reqs]``)."""
    expected = CpuMirror(exp.shape[1], rank=state.mirror.rank)
    for i, f in enumerate(MIRROR_FIELDS):
        np.copyto(expected.array(f), exp[i])
    expected.validate_blocks(state.block_size, p.live, p.step, owners=p.owners,
                             spec_slack=2 * (state.width - 1))


def _raise_digest(dev, p, rank: int | None) -> None:
    """The first step row (by slot) whose table digest, computed on the device, differs from
    the scheduler's: field ``block_ids (digest vs scheduler)``, ``cpu`` = the rank's digest,
    ``device`` = the scheduler's (as ``ppstate.block_digest.check_row_digests``)."""
    aux = dev.aux_np[p.buf]                                   # [3, n]: live, rows, digests
    got = dev.dig_dev[p.buf].cpu().numpy()                    # [n]
    bad = np.flatnonzero((aux[1] != 0) & (got != aux[2]))
    if bad.size:
        slot = int(bad[0])
        raise MirrorDivergence(step=p.step, slot=slot, field="block_ids (digest vs scheduler)",
                               req_id=p.owners[slot], cpu=int(got[slot]),
                               device=int(aux[2, slot]), rank=rank)
