"""Process groups of the model checker: what is faithful enough to catch a hang.

Two groups over the same ``pp_size`` ranks, as in the runtime (``runtime/worker/groups.py``): ``pp``
(hidden states rank to rank by p2p; in sync mode also the blocking sampled-token broadcast) and
``bcast`` (the overlapped side group of the deferred broadcast). The rules:

* Operations on one group complete in the order each rank issued them: an op completes only
  after every op its rank issued earlier on that group completed (NCCL's stream order).
* A p2p send from r to r + 1 is matched with the receive on r + 1 of the same index on that link;
  the k-th collective of each rank on a group is matched with the k-th of every other rank. An op
  completes when it and all its partners are at the head of their ranks' queues.
* Issuing never blocks; a blocking wait blocks its rank until the op completed (the caller
  raises :class:`Blocked`). Ops whose partners never come leave their ranks blocked: a deadlock.
* Matched collectives that disagree on the step they broadcast are a collective mismatch
  (invariant 1): the runtime would broadcast buffers of different steps (or sizes) into each
  other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Blocked(Exception):
    """A rank's blocking wait cannot complete in this state (it waits for ``op``)."""

    def __init__(self, op: "Op") -> None:
        super().__init__(f"rank {op.rank} waits for {op.describe()}")
        self.op = op


@dataclass
class Op:
    """One issued communication op.

    Attributes:
        group: ``pp`` or ``bcast``. kind: ``send`` / ``recv`` (p2p) or ``bcast`` (collective).
        rank: issuing rank. peer: the other rank of a p2p op (-1 for collectives).
        step: the step whose data the op carries. index: its match index (per link or per group).
        payload: what the sender / broadcast root gives (``None`` on receivers until done).
        done: completed.
    """
    group: str
    kind: str
    rank: int
    peer: int
    step: int
    index: int
    payload: Any = None
    done: bool = False
    is_root: bool = False

    def __deepcopy__(self, memo: dict) -> "Op":
        return self   # ops are shared by the comm queues and the ranks' logs and handles

    def describe(self) -> str:
        what = {"send": f"send to rank {self.peer}", "recv": f"receive from rank {self.peer}",
                "bcast": "broadcast"}[self.kind]
        return f"{what} of step {self.step} on the {self.group} group"


@dataclass
class Comm:
    """All ops issued so far, per group and rank (completed prefixes are dropped)."""
    pp_size: int
    queues: dict[tuple[str, int], list[Op]] = field(default_factory=dict)   # (group, rank) -> ops
    p2p_count: dict[tuple[str, int, int, str], int] = field(default_factory=dict)
    coll_count: dict[tuple[str, int], int] = field(default_factory=dict)
    mismatches: list[tuple[str, int]] = field(default_factory=list)   # (message, step)

    def issue(self, group: str, kind: str, rank: int, step: int, peer: int = -1,
              payload: Any = None, is_root: bool = False) -> Op:
        """Issue an op (never blocks) and complete whatever can complete now."""
        if kind == "bcast":
            key = (group, rank)
            index = self.coll_count.get(key, 0)
            self.coll_count[key] = index + 1
        else:
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            key2 = (group, src, dst, kind)
            index = self.p2p_count.get(key2, 0)
            self.p2p_count[key2] = index + 1
        op = Op(group, kind, rank, peer, step, index, payload, is_root=is_root)
        self.queues.setdefault((group, rank), []).append(op)
        self._progress()
        return op

    def head(self, group: str, rank: int) -> Op | None:
        """The oldest op of ``rank`` on ``group`` not yet complete, or None."""
        q = self.queues.get((group, rank))
        return q[0] if q else None

    def _partners(self, op: Op) -> list[Op] | None:
        """The heads of the partner ranks' queues if they are op's partners, else None."""
        if op.kind == "bcast":
            heads = [self.head(op.group, r) for r in range(self.pp_size) if r != op.rank]
            if any(h is None or h.kind != "bcast" for h in heads):
                return None
            return heads
        head = self.head(op.group, op.peer)
        want = "recv" if op.kind == "send" else "send"
        if head is None or head.kind != want or head.peer != op.rank or head.index != op.index:
            return None
        return [head]

    def _progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for (group, rank), q in list(self.queues.items()):
                if not q:
                    continue
                op = q[0]
                partners = self._partners(op)
                if partners is None:
                    continue
                self._complete(op, partners)
                moved = True

    def _complete(self, op: Op, partners: list[Op]) -> None:
        ops = [op, *partners]
        if op.kind == "bcast":
            steps = {o.step for o in ops}
            roots = [o for o in ops if o.is_root]
            if len(steps) > 1 or len(roots) != 1:
                self.mismatches.append((
                    f"collective mismatch on the {op.group} group, collective #{op.index}: "
                    + ", ".join(f"rank {o.rank} {'sends' if o.is_root else 'receives'} step "
                                f"{o.step}" for o in sorted(ops, key=lambda o: o.rank)),
                    min(o.step for o in ops)))
            payload = roots[0].payload if roots else None
        else:
            payload = next(o.payload for o in ops if o.kind == "send")
        for o in ops:
            o.payload, o.done = payload, True
            self.queues[(o.group, o.rank)].pop(0)

    def take_mismatches(self) -> list[tuple[str, int]]:
        """Collective mismatches found since the last call: ``(message, step)``."""
        out, self.mismatches = self.mismatches, []
        return out

    def pending(self) -> list[Op]:
        """Ops issued and not complete, in (group, rank) order."""
        return [op for _, q in sorted(self.queues.items()) for op in q]
