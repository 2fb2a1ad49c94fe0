"""Known-bad variants of the core, switched on by name for the model checker (``ppstate.check``).

A mutant is not a copy of the code: each is a one-line ``if mutants.active("name"):`` at the
decision point it breaks, in the code that runs. All are off unless a caller switches one on with
:func:`enabled` (a context manager; the checker's ``--mutant NAME``). Off, a hook costs one set
lookup on an empty set.

The first seven, each a bug another engine shipped or nearly shipped (docs/design.md §9), and
``keep_rejected_draft``, the simulator's (docs/spec_decode.md):

==============================  =================================================================
``rank_local_skip``             the last rank decides the broadcast skip from its own state (it
                                skips when its CPU mirror says every sampled row produced its
                                request's last token), while the other ranks decide from the
                                scheduler output
``no_generation_check``         the PPHandler applies deferred rows without comparing the slot's
                                generation (stale tokens after slot reuse)
``short_cadence``               decode cadence ``pp_size - 1`` instead of ``pp_size``
``blocking_all_chunk_broadcast``  the sampled-token broadcast is posted on the p2p group and waited
                                for at once on every step, even when every row is a non-final
                                chunk (as before vLLM #38726)
``no_rejected_correction``      the CPU mirror is not corrected for rejected speculative tokens
``rank_local_block_shift``      rank 1 writes the block ids of one slot's deltas shifted by one
                                (a rank-local block-table error: its reads and KV writes go to
                                other requests' blocks)
``grammar_on_rejected``         a structured-output request's grammar matcher advances on every
                                verified position, rejected drafts included (its grammar
                                position runs ahead of the accepted output; vLLM #45014's class)
``keep_rejected_draft``         rank 0 applies a consumed payload without its rejections: device
                                counters and mirror both keep rejected drafts' positions (they
                                agree, so only the simulator's KV model sees it; the checker
                                does not model KV contents)
==============================  =================================================================
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

#: name -> one-line description (``python -m ppstate.check --list-mutants``)
MUTANTS: dict[str, str] = {
    "rank_local_skip": "the last rank decides the broadcast skip from its own state "
                       "(skips when its mirror says every sampled row's request just finished)",
    "no_generation_check": "deferred rows are applied without the slot-generation check",
    "short_cadence": "decode cadence pp_size - 1 instead of pp_size",
    "blocking_all_chunk_broadcast": "sampled-token broadcast on the p2p group, waited for at "
                                    "once, on every step (also all-non-final-chunk steps)",
    "no_rejected_correction": "CPU mirror not corrected for rejected speculative tokens",
    "rank_local_block_shift": "rank 1 applies one slot's block-table deltas with every id + 1 "
                              "(ppstate.block_digest.rank_deltas)",
    "grammar_on_rejected": "the grammar matcher advances on rejected speculative tokens too",
    "keep_rejected_draft": "rank 0 applies consumed payloads without their rejections (device "
                           "and mirror keep rejected drafts' positions; caught by ppstate.sim)",
}

_active: set[str] = set()


def active(name: str) -> bool:
    """True while mutant ``name`` is switched on (never in normal runs)."""
    return name in _active


def active_names() -> list[str]:
    """The mutants switched on now, sorted (recorded in a simulator trace's header)."""
    return sorted(_active)


def any_active() -> bool:
    """True while any mutant is switched on."""
    return bool(_active)


@contextmanager
def enabled(*names: str) -> Iterator[None]:
    """Switch the named mutants on for the ``with`` block.

    Raises:
        KeyError: an unknown mutant name (the message lists the known ones).
    """
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise KeyError(f"unknown mutant {unknown[0]!r}; known: {', '.join(sorted(MUTANTS))}")
    before = set(_active)
    _active.update(names)
    try:
        yield
    finally:
        _active.clear()
        _active.update(before)


def rank_local_mask(backend: Any, out: Any, mask: np.ndarray) -> np.ndarray | None:
    """Mutant ``rank_local_skip``'s decision on the last rank, from its own CPU mirror
    (``backend.mirror``): None ("nobody needs the last token of a finished request") when every
    row of ``mask`` reached ``max_seq_len - 1`` computed tokens, else ``mask``."""
    mirror = backend.mirror
    slots = np.asarray(out.slots, dtype=np.int64)[np.asarray(mask, dtype=bool)]
    done = mirror.num_computed_tokens_np[slots] >= mirror.max_seq_len_np[slots] - 1
    return None if bool(done.all()) else mask
