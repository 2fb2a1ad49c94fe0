"""The sampled-token broadcast payload: a typed view of one ``[num_rows, width + 2]`` int64 buffer.

The last rank samples each step's rows and hands every other rank one buffer, broadcast on the
side group. Its columns, per row:

* ``[:, :width]`` ``token_ids``: the sampled ids (``width`` = 1 + speculative tokens; 1 now);
  only the first ``num_sampled`` of a row are meaningful.
* ``[:, width]`` ``num_sampled``: ids accepted for the row (0 for a row that needed no sample,
  1 without speculative decoding).
* ``[:, width + 1]`` ``num_rejected``: positions the forward computed that must be taken back
  (rejected draft tokens); subtracted from ``num_computed_tokens`` and the KV position when the
  payload is applied (0 without speculative decoding).

One buffer keeps the broadcast a single collective; this view keeps the index arithmetic in one
place. It works over any 2-D array that supports numpy-style slicing (a numpy array in the
simulator, a torch tensor in the runtime), so ``ppstate`` needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampledPayload:
    """View of a broadcast buffer ``buf``: ``[num_rows, width + 2]`` int64 (numpy or torch).

    Properties return views (not copies) of ``buf``, so writes through them land in the buffer.

    Raises:
        ValueError: ``buf`` is not 2-D with at least 3 columns.
    """
    buf: Any

    def __post_init__(self) -> None:
        shape = tuple(self.buf.shape)
        if len(shape) != 2 or shape[1] < 3:
            raise ValueError(f"payload buffer must be [num_rows, width + 2] with width >= 1, "
                             f"got shape {shape}")

    @staticmethod
    def shape(num_rows: int, width: int) -> tuple[int, int]:
        """Buffer shape of a step with ``num_rows`` rows and ``width`` ids per row."""
        return (num_rows, width + 2)

    @classmethod
    def zeros(cls, num_rows: int, width: int = 1) -> "SampledPayload":
        """A numpy payload with nothing sampled (``num_sampled = num_rejected = 0``)."""
        return cls(np.zeros(cls.shape(num_rows, width), dtype=np.int64))

    @property
    def num_rows(self) -> int:
        """Rows of the step."""
        return int(self.buf.shape[0])

    @property
    def width(self) -> int:
        """Sampled ids per row (1 + speculative tokens)."""
        return int(self.buf.shape[1]) - 2

    @property
    def token_ids(self) -> Any:
        """``[num_rows, width]`` sampled ids."""
        return self.buf[:, :self.width]

    @property
    def num_sampled(self) -> Any:
        """``[num_rows]`` ids accepted per row."""
        return self.buf[:, self.width]

    @property
    def num_rejected(self) -> Any:
        """``[num_rows]`` computed positions to take back per row (rejected draft tokens)."""
        return self.buf[:, self.width + 1]
