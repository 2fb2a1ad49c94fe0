"""Sampling parameters of every slot, as slot-indexed arrays (the last rank samples from them).

Written once per request at admission (:meth:`SamplingState.admit`), read every step by
:meth:`SamplingState.batch`, which gathers the step's rows by their slots (``idx_mapping``) on the
device: one ``index_select`` per packed table, no per-row Python. The per-step branch choices of
:func:`runtime.sampling.sampler.sample` (which rows are greedy, cut by top-k / top-p, penalised; the
largest top-k; logprob counts) are made over host copies of the same arrays with vectorised numpy,
so choosing a code path never reads the device.

The host copies keep the request's values exactly (float64, as the request gave them); the device
tables hold them in the dtypes the sampler computes with (fp32; int64), so tokens are identical to
the per-row :meth:`runtime.sampling.batch.SamplingBatch.build`
(tests/runtime/test_sampling_state.py).

Seeded rows draw their uniform on the device with the same splitmix64 hash as
:func:`runtime.sampling.batch.seeded_uniform` (int64 arithmetic wraps like uint64; shifts are made
logical with a mask), so a seeded request's tokens do not depend on the device, its batch or earlier
steps. Unseeded rows take one batched draw from the device's default generator (on the CPU: torch's
global generator, the same draw as before).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.host_copy import to_device
from runtime.sampling.batch import SamplingBatch

# Packed device tables: fp32 columns and int64 columns.
_TEMPERATURE, _TOP_P, _PRESENCE, _FREQUENCY, _REPETITION = range(5)
_TOP_K, _SEED, _HAS_SEED, _PROMPT_LEN = range(4)

_M64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """The int64 with the bits of the uint64 ``c``."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` bits (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_t(z: torch.Tensor) -> torch.Tensor:
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_uniform_t(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """:func:`runtime.sampling.batch.seeded_uniform` over tensors, on their device.

    Args: seed, output_index: ``[N]`` int64 (seeds in ``[0, 2**63)``, indices >= 0).
    Returns: ``[N]`` fp64 in ``[0, 1)``, bit-identical to the Python function.
    """
    h = _splitmix64_t(_splitmix64_t(seed) ^ output_index)
    return _shr(h, 11).double() * 2.0 ** -53


class SamplingState:
    """Per-slot sampling parameters on ``device`` (packed tables) and on the host (numpy).

    Args:
        max_num_reqs: slots.
        device: where the last rank samples.
    """

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        n, self.device = max_num_reqs, device
        self.f32 = torch.zeros(n, 5, dtype=torch.float32, device=device)      # [max_num_reqs, 5]
        self.i64 = torch.zeros(n, 4, dtype=torch.int64, device=device)        # [max_num_reqs, 4]
        # Column views of the device tables (what the sampler reads, gathered per step).
        self.temperature = self.f32[:, _TEMPERATURE]      # [max_num_reqs] fp32, 1 on greedy slots
        self.top_p = self.f32[:, _TOP_P]                  # [max_num_reqs] fp32, 1 = no cut
        self.presence = self.f32[:, _PRESENCE]            # [max_num_reqs] fp32
        self.frequency = self.f32[:, _FREQUENCY]          # [max_num_reqs] fp32
        self.repetition = self.f32[:, _REPETITION]        # [max_num_reqs] fp32, 1 = none
        self.top_k = self.i64[:, _TOP_K]                  # [max_num_reqs] int64, 0 = no cut
        self.seed = self.i64[:, _SEED]                    # [max_num_reqs] int64
        self.has_seed = self.i64[:, _HAS_SEED]            # [max_num_reqs] int64 0/1
        self.prompt_len = self.i64[:, _PROMPT_LEN]        # [max_num_reqs] int64, output index base
        # Host copies: the request's exact values, for per-step branch choices.
        self.temperature_np = np.zeros(n, dtype=np.float64)     # [max_num_reqs]
        self.top_p_np = np.ones(n, dtype=np.float64)            # [max_num_reqs]
        self.top_k_np = np.zeros(n, dtype=np.int64)             # [max_num_reqs]
        self.has_seed_np = np.zeros(n, dtype=bool)              # [max_num_reqs]
        self.penalized_np = np.zeros(n, dtype=bool)             # [max_num_reqs]
        self.num_logprobs_np = np.full(n, -1, dtype=np.int64)   # [max_num_reqs] -1 = none
        # Host copies of the device tables exactly as uploaded (mirror validation compares them).
        self.f32_np = np.zeros((n, 5), dtype=np.float32)        # [max_num_reqs, 5]
        self.i64_np = np.zeros((n, 4), dtype=np.int64)          # [max_num_reqs, 4]

    def admit(self, slots: Sequence[int], params: Sequence, prompt_lens: Sequence[int]) -> None:
        """Write the parameters of newly admitted requests (host copies, then one upload per table).

        Args:
            slots: ``[k]`` slots.
            params: ``[k]`` :class:`~runtime.sampling_params.SamplingParams` (or objects with its
                attributes).
            prompt_lens: ``[k]`` prompt tokens before the request's first output token (tokens):
                output number ``j`` is sampled at position ``prompt_len + j``.
        """
        if not slots:
            return
        s = np.asarray(slots, dtype=np.int64)
        temp = np.array([p.temperature for p in params], dtype=np.float64)
        top_k = np.array([max(p.top_k, 0) for p in params], dtype=np.int64)
        seed = [p.seed for p in params]
        pen = np.array([(p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                        for p in params], dtype=np.float64).reshape(-1, 3)
        self.temperature_np[s] = temp
        self.top_p_np[s] = [p.top_p for p in params]
        self.top_k_np[s] = top_k
        self.has_seed_np[s] = [x is not None for x in seed]
        self.penalized_np[s] = (pen[:, 0] != 0.0) | (pen[:, 1] != 0.0) | (pen[:, 2] != 1.0)
        self.num_logprobs_np[s] = [-1 if p.logprobs is None else p.logprobs for p in params]
        f32 = np.empty((len(s), 5), dtype=np.float32)
        f32[:, _TEMPERATURE] = np.where(temp == 0.0, 1.0, temp)
        f32[:, _TOP_P] = self.top_p_np[s]
        f32[:, _PRESENCE:] = pen
        i64 = np.empty((len(s), 4), dtype=np.int64)
        i64[:, _TOP_K] = top_k
        i64[:, _SEED] = [0 if x is None else x for x in seed]
        i64[:, _HAS_SEED] = self.has_seed_np[s]
        i64[:, _PROMPT_LEN] = prompt_lens
        self.f32_np[s], self.i64_np[s] = f32, i64
        idx = to_device(s, self.device)
        self.f32[idx] = to_device(f32, self.device)
        self.i64[idx] = to_device(i64, self.device)

    def batch(self, slots: np.ndarray, positions_after: np.ndarray) -> tuple[SamplingBatch, torch.Tensor]:
        """The :class:`SamplingBatch` of one step's sampled rows.

        Args:
            slots: ``[R]`` int64 slot of each sampled row (the step's ``idx_mapping`` restricted
                to the rows that sample).
            positions_after: ``[R]`` int64 tokens of each row once this step is computed
                (start position + scheduled tokens): the position of the token sampled now.
        Returns:
            (batch, slots_t): the batch (device tensors gathered by slot) and ``slots`` on the
            device, ``[R]`` int64.
        """
        dev = self.device
        slots_t = to_device(slots, dev, torch.int64)
        f = self.f32.index_select(0, slots_t)    # [R, 5]
        i = self.i64.index_select(0, slots_t)    # [R, 4]
        greedy = self.temperature_np[slots] == 0.0
        top_k, top_p = self.top_k_np[slots], self.top_p_np[slots]
        cut = ~greedy & ((top_k > 0) | (top_p < 1.0))
        pen = self.penalized_np[slots]
        lps = self.num_logprobs_np[slots]
        r = len(slots)
        if greedy.all():    # no row draws: skip the RNG (sample() reads no uniform then)
            uniform = torch.empty(r, dtype=torch.float64, device=dev)
        else:
            uniform = torch.rand(r, dtype=torch.float64, device=dev)
        if self.has_seed_np[slots].any():
            pos = to_device(positions_after, dev, torch.int64)
            seeded = seeded_uniform_t(i[:, _SEED], pos - i[:, _PROMPT_LEN])
            uniform = torch.where(i[:, _HAS_SEED].bool(), seeded, uniform)
        pen_rows = _rows(pen, dev)
        return SamplingBatch(
            temperature=f[:, _TEMPERATURE],
            top_k=i[:, _TOP_K],
            top_p=f[:, _TOP_P],
            uniform=uniform,
            greedy=torch.from_numpy(greedy),        # host: only its length is read
            plain_rows=_rows(~greedy & ~cut, dev),
            cut_rows=_rows(cut, dev),
            max_top_k=int(top_k[cut].max()) if cut.any() else 0,
            top_p_only=bool((cut & (top_k <= 0)).any()),
            max_num_logprobs=int(lps.max()) if r else -1,
            num_greedy=int(greedy.sum()),
            penalty_rows=pen_rows,
            presence=None if pen_rows is None else f[pen_rows, _PRESENCE],
            frequency=None if pen_rows is None else f[pen_rows, _FREQUENCY],
            repetition=None if pen_rows is None else f[pen_rows, _REPETITION],
        ), slots_t


def _rows(mask: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """Indices of the true entries of ``mask`` ``[R]`` on ``device``, or None when there are none."""
    if not mask.any():
        return None
    return to_device(np.flatnonzero(mask).astype(np.int64), device)
