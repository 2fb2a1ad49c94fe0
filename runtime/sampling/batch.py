"""One step's sampling parameters on the device (:class:`SamplingBatch`), built per row from the
requests' :class:`~runtime.sampling_params.SamplingParams`, and the seeded uniform each row draws.

The engine builds a one-row batch for every request before admitting it (a request whose
parameters cannot be built fails alone), so this module imports nothing of the sampler itself.
The slot-indexed, per-step path of the ranks is :mod:`runtime.sampling.sampling_state`, which
builds the same batch from device tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from runtime.sampling.logit_bias import row_bias

if TYPE_CHECKING:  # duck-typed at runtime: the GPU box has no pydantic
    from runtime.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, output_index: int) -> float:
    """The uniform in [0, 1) that decides a seeded request's `output_index`-th token (0-based).
    A pure function of its arguments: stable across processes, devices and Python versions."""
    h = _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64))
    return (h >> 11) * 2.0 ** -53


def _rows(mask: list[bool], device: torch.device | str) -> torch.Tensor | None:
    idx = [i for i, m in enumerate(mask) if m]
    return torch.tensor(idx, dtype=torch.int64, device=device) if idx else None


@dataclass
class SamplingBatch:
    """Device-side sampling parameters of one step's R rows (row i = params[i]).

    Attributes:
        temperature: [R] fp32; 1.0 on greedy rows (unused there).
        top_k: [R] int64, 0 = no top-k.
        top_p: [R] fp32 in (0, 1], 1 = no top-p.
        uniform: [R] fp64 in [0, 1), the random number each sampled row uses.
        greedy: [R] bool, temperature == 0.
        plain_rows / cut_rows: int64 row indices of the non-greedy rows without / with a top-k or
            top-p cut (None when empty).
        max_top_k: largest top_k among cut rows (0 if none); top_p_only: some cut row has top-p
            but no top-k.
        max_num_logprobs: -1 if no row wants logprobs, else max(params.logprobs).
        num_greedy: number of greedy rows.
        penalty_rows: int64 indices of the rows with any penalty (None when none).
        presence / frequency / repetition: [P] fp32 penalties of ``penalty_rows``.
        logit_bias: ``(rows [B], ids [B, K], values [B, K])`` of the rows with a ``logit_bias``
            (:mod:`runtime.sampling.logit_bias`), or None.
    """
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    uniform: torch.Tensor
    greedy: torch.Tensor
    plain_rows: torch.Tensor | None
    cut_rows: torch.Tensor | None
    max_top_k: int
    top_p_only: bool
    max_num_logprobs: int
    num_greedy: int
    penalty_rows: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    logit_bias: tuple | None = None

    @property
    def num_rows(self) -> int:
        return int(self.greedy.shape[0])

    @property
    def any_greedy(self) -> bool:
        return self.num_greedy > 0

    @property
    def all_greedy(self) -> bool:
        return self.num_greedy == self.num_rows

    @classmethod
    def build(cls, params: Sequence[SamplingParams], output_index: Sequence[int],
              device: torch.device | str = "cpu") -> "SamplingBatch":
        """Args: params: one per row; output_index: per row, the index (0-based, among the
        request's generated tokens) of the token sampled now; device: where the logits live.
        Raises: ValueError if the lengths differ."""
        if len(params) != len(output_index):
            raise ValueError(f"{len(params)} params but {len(output_index)} output indices")
        greedy = [p.temperature == 0.0 for p in params]
        top_k = [max(p.top_k, 0) for p in params]
        cut = [not g and (p.top_k > 0 or p.top_p < 1.0) for p, g in zip(params, greedy)]
        uniform = torch.rand(len(params), dtype=torch.float64)
        for i, (p, o) in enumerate(zip(params, output_index)):
            if p.seed is not None:
                uniform[i] = seeded_uniform(p.seed, int(o))
        lps = [p.logprobs for p in params if p.logprobs is not None]
        pen = [(getattr(p, "presence_penalty", 0.0), getattr(p, "frequency_penalty", 0.0),
                getattr(p, "repetition_penalty", 1.0)) for p in params]
        pen_rows = [i for i, (a, b, c) in enumerate(pen) if a != 0.0 or b != 0.0 or c != 1.0]

        def pen_col(j: int) -> torch.Tensor | None:
            if not pen_rows:
                return None
            return torch.tensor([pen[i][j] for i in pen_rows], dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            uniform=uniform.to(device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            plain_rows=_rows([not g and not c for g, c in zip(greedy, cut)], device),
            cut_rows=_rows(cut, device),
            max_top_k=max((k for k, c in zip(top_k, cut) if c), default=0),
            top_p_only=any(c and p.top_k <= 0 for p, c in zip(params, cut)),
            max_num_logprobs=max(lps, default=-1),
            num_greedy=sum(greedy),
            penalty_rows=_rows([i in set(pen_rows) for i in range(len(params))], device),
            presence=pen_col(0), frequency=pen_col(1), repetition=pen_col(2),
            logit_bias=row_bias(params, device),
        )
