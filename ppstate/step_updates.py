"""The tokens one step result delivers, as columns: :class:`StepUpdates`.

:meth:`ppstate.scheduler.Scheduler.on_step_result` applies a step's one-token rows with array
operations; building one :class:`~ppstate.request.TokenUpdate` object per row would cost more than
all the rest of the step. ``StepUpdates`` keeps the rows as columns (request ids, token ids, the
few finish reasons) and makes a ``TokenUpdate`` only when a row is read, so a caller that only
counts or looks up rows pays nothing per row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from ppstate.request import TokenUpdate


def count_tokens(updates: Sequence[TokenUpdate]) -> int:
    """Tokens in ``updates`` (what ``on_step_result`` returned); O(1) for :class:`StepUpdates`."""
    if isinstance(updates, StepUpdates):
        return updates.num_tokens
    return sum(len(u.token_ids) for u in updates)


class StepUpdates(Sequence[TokenUpdate]):
    """One :class:`~ppstate.request.TokenUpdate` per live sampling row of a step, in row order,
    each with exactly one token (rows with several tokens, speculative decoding, come back as a
    plain ``list[TokenUpdate]``).

    Args:
        req_ids: ``[n]`` request id of each update.
        token_ids: ``[n]`` the one token id of each update (python ints).
        finish_reasons: update index -> finish reason ("stop" | "length") of the updates that end
            their request; the others are None.

    Compares equal to any sequence of equal TokenUpdates (e.g. a list).
    """

    __slots__ = ("req_ids", "token_ids", "finish_reasons")

    def __init__(self, req_ids: Sequence[str], token_ids: Sequence[int],
                 finish_reasons: dict[int, str]) -> None:
        self.req_ids, self.token_ids, self.finish_reasons = req_ids, token_ids, finish_reasons

    def __len__(self) -> int:
        return len(self.req_ids)

    def _item(self, i: int) -> TokenUpdate:
        return TokenUpdate(self.req_ids[i], [self.token_ids[i]], self.finish_reasons.get(i))

    @overload
    def __getitem__(self, i: int) -> TokenUpdate: ...
    @overload
    def __getitem__(self, i: slice) -> list[TokenUpdate]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(k) for k in range(len(self))[i]]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"update {i} out of range ({n} updates)")
        return self._item(i % n)

    def __iter__(self) -> Iterator[TokenUpdate]:
        get = self.finish_reasons.get
        return (TokenUpdate(r, [t], get(i)) for i, (r, t) in enumerate(zip(self.req_ids, self.token_ids)))

    def as_dicts(self) -> list[dict]:
        """The updates as the trace records them (``vars`` of each :class:`TokenUpdate`, same
        keys and order), built from the columns without making the updates."""
        get = self.finish_reasons.get
        return [{"req_id": r, "token_ids": [t], "finish_reason": get(i)}
                for i, (r, t) in enumerate(zip(self.req_ids, self.token_ids))]

    @property
    def num_tokens(self) -> int:
        """Tokens delivered (one per update), without making the updates."""
        return len(self.req_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"StepUpdates({list(self)!r})"
