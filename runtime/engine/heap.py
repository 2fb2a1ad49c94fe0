"""The engine process's garbage-collector setting: the heap alive at startup is frozen once.

CPython's cyclic collector walks every tracked object of a generation. The engine process holds
~190k tracked objects from its imports (torch, numpy, tokenizers, pydantic) and the objects made
while starting; a full (oldest-generation) collection walks all of them, which measured 110-290 ms
on the 2-core development machine in the middle of a 256-row ``engine_host`` run of ~0.6 s
(one or two per run: a step's increments, futures and handles keep promoting survivors).
:func:`gc.freeze` moves every object alive at that moment to a permanent generation that no
collection walks, so a full collection walks only what was made after it (7-45 ms measured).
Objects frozen are never collected, even when they later become cyclic garbage: hence a
``gc.collect()`` first and once per process (the first engine to start), never per request.
"""

from __future__ import annotations

import gc

_frozen = False


def freeze_startup_heap() -> int:
    """Collect, then freeze every tracked object alive now; only the first call per process does
    anything (later engines in the same process, e.g. in tests, leave the collector alone).

    Returns:
        Objects in the permanent generation after the call (``gc.get_freeze_count()``).
    """
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
