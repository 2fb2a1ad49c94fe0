"""Whether a decode row should carry drafts at all: the scheduler's n-gram probe (issue #33).

A row with ``k`` drafts costs ``1 + k`` tokens of compute and KV, but when the request's last
``n`` tokens occur nowhere earlier in its history, the prompt-lookup proposer
(:func:`ppstate.speculative.propose_ngram`) finds nothing and every draft is padding, almost
always rejected. With ``SchedulerConfig.spec_probe_ngram = n`` (> 0) the scheduler gives such a
row no drafts: speculation turns itself off per row, and a step whose rows all lack proposals is
a plain decode step (on CUDA it replays the ordinary decode graph).

The probe reads the history the scheduler knows (prompt + received outputs). In overlapped mode
that history may lag the ranks' by the rows still in flight, so the probe is a heuristic only:
the ranks still compute their own drafts (and pad) for whatever ``k`` the row carries, which
keeps the result correct whatever the probe says. Cost: each token is indexed once (a dict of
the request's n-grams, :class:`NgramProbe`), a lookup is one dict probe.
"""

from __future__ import annotations

import weakref


class _Index:
    """n-gram -> most recent start of one request's history, over starts ``< indexed``."""
    __slots__ = ("starts", "indexed", "__weakref__")

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], int] = {}
        self.indexed = 0


class NgramProbe:
    """Per-request incremental n-gram index (held weakly: it goes with the request).

    Args:
        n: the proposer's n-gram length (>= 1).
    Raises:
        ValueError: ``n < 1``.
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self._index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def has_proposal(self, req, prompt: tuple[int, ...], outputs: list[int]) -> bool:
        """Whether the last ``n`` tokens of ``prompt + outputs`` occur earlier (ending before the
        last token), i.e. whether :func:`~ppstate.speculative.propose_ngram` matches.

        Args:
            req: the request (the index's key; any weak-referenceable object).
            prompt: its prompt ids; outputs: ``[num_outputs]`` its received output ids (any
                sequence, e.g. the scheduler's ``out_tokens`` row; only ever appended to while
                the request lives).
        """
        n = self.n
        total = len(prompt) + len(outputs)
        if total <= n:
            return False
        idx = self._index.get(req)
        if idx is None:
            idx = self._index[req] = _Index()
        lo = min(idx.indexed, total - n)      # the positions read: lo .. total - 1, as ints
        seg = _ints(prompt, outputs, lo)
        # index every n-gram that ends before the last token: starts 0 .. total - 1 - n
        for s in range(idx.indexed, total - n):
            idx.starts[tuple(seg[s - lo:s - lo + n])] = s
        idx.indexed = max(idx.indexed, total - n)
        tail = tuple(seg[total - n - lo:])
        return tail in idx.starts


def _ints(prompt, outputs, lo: int) -> list[int]:
    """Tokens ``lo ..`` of ``prompt + outputs`` as Python ints (one slice of each sequence,
    ``tolist`` for arrays: no per-token indexing, #33)."""
    lp = len(prompt)
    head = [int(t) for t in prompt[lo:]] if lo < lp else []
    tail = outputs[max(0, lo - lp):]
    return head + (tail.tolist() if hasattr(tail, "tolist") else [int(t) for t in tail])
