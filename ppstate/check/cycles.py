"""Livelock check of the canonical state graph: a cycle of engine moves.

With relative step numbers (:mod:`ppstate.check.renumber`) a run that issues steps forever without
any request progressing is a *cycle* in the explored graph, where the absolute step bound of the
``--no-canon`` mode saw ever larger step numbers. Arrivals only grow the arrival count, and an
abort ends a live request, whose id is never live again; a delivered token grows the client's
record of its request until the request is dead and forgotten, which is final too. So a cycle can
only consist of engine moves (a result delivered, with ``--async`` a step issued, with
``--no-por`` a rank step) in which no request gains a token or finishes: a livelock.

:class:`EdgeLog` keeps the engine-move edges of the explored graph (two int64 per edge and a small
code for the action) and :meth:`EdgeLog.find_cycle` peels nodes without predecessors (Kahn's
algorithm, in numpy rounds); what remains lies on or behind a cycle, and walking predecessors
from any remaining node must repeat one.
"""

from __future__ import annotations

from array import array

import numpy as np



def move_code(codes: dict[tuple, int], moves: list[tuple], action: tuple, choices: tuple) -> int:
    """The small integer naming move ``(action, choices)`` in the table ``codes`` / ``moves``
    (appended on first sight), so that per-edge logs store 4 bytes instead of the tuples."""
    move = (tuple(action), tuple(choices))
    code = codes.get(move)
    if code is None:
        code = codes[move] = len(moves)
        moves.append(move)
    return code

class EdgeLog:
    """Engine-move edges ``src -> dst`` (state ids) with the action taken."""

    ENGINE_MOVES = ("deliver", "issue", "rank")

    def __init__(self) -> None:
        self.src, self.dst, self.code = array("q"), array("q"), array("i")
        self._codes: dict[tuple, int] = {}
        self._moves: list[tuple] = []

    def __len__(self) -> int:
        return len(self.src)

    def add(self, src: int, dst: int, action: tuple, choices: tuple) -> None:
        self.src.append(src)
        self.dst.append(dst)
        self.code.append(move_code(self._codes, self._moves, action, choices))

    def find_cycle(self) -> tuple[int, list[tuple]] | None:
        """A cycle as ``(first state id, [(action, choices), ...])``, or None."""
        if not self.src:
            return None
        src = np.frombuffer(self.src, dtype=np.int64)
        dst = np.frombuffer(self.dst, dtype=np.int64)
        n = int(max(src.max(), dst.max())) + 1
        alive_edge = src != dst
        if not alive_edge.all():                      # a self-loop is a cycle of one move
            i = int(np.argmin(alive_edge))
            return int(src[i]), [self._moves[self.code[i]]]
        indeg = np.bincount(dst, minlength=n)
        removed = np.zeros(n, dtype=bool)
        while True:
            peel = (indeg == 0) & ~removed
            if not peel.any():
                break
            removed |= peel
            gone = alive_edge & peel[src]
            alive_edge &= ~gone
            indeg -= np.bincount(dst[gone], minlength=n)
        if not alive_edge.any():
            return None
        pred = {}                                      # remaining node -> one remaining edge in
        for i in np.nonzero(alive_edge)[0].tolist():
            pred.setdefault(int(dst[i]), i)
        node, walk, at = next(iter(pred)), [], {}
        while node not in at:
            at[node] = len(walk)
            e = pred[node]
            walk.append(e)
            node = int(src[e])
        loop = walk[at[node]:][::-1]                   # edges in forward order, from `node`
        return int(src[loop[0]]), [self._moves[self.code[e]] for e in loop]
