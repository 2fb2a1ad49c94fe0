"""The order of one rank's step as the model checker runs it (:class:`CheckStep`).

The same order, and the same calls in the same places, as the shared rank step of the runtime and
the simulator (docs/design.md §5): begin -> deferred consume (the PPHandler waits on the posted
receive; usable rows applied) -> PPHandler generations of freed slots -> free / admit ->
non-empty steps: inputs -> receive -> forward -> send -> immediate post-update -> last rank:
sample -> apply -> publish (broadcast or skip) -> result; other ranks: post the receive and
enqueue it, or enqueue an empty entry and skip -> end (validate the mirrors). ``depth`` is
``pp_size`` in overlapped mode and 1 in sync mode.

Two mutant hooks (``ppstate/mutants.py``) sit at the decisions they break:
``rank_local_skip`` (the last rank drops rows from its broadcast decision by its own count of a
request's tokens) and ``blocking_all_chunk_broadcast`` (every step's broadcast waited for at
once, also when no row needs it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput, StepResult
from ppstate.events import NULL_SINK, EventSink
from ppstate.pp_handler import PPHandler, need_sampled_mask


def sampled_idx_mapping(out: SchedulerOutput, mask: np.ndarray | None) -> np.ndarray:
    """``[num_rows]`` int64: the slot of each row that needs a sample, -1 elsewhere."""
    if mask is None:
        return np.full(out.num_rows, -1, dtype=np.int64)
    return np.where(mask, out.slots, -1).astype(np.int64)


class CheckStep:
    """Runs steps of rank ``rank`` of ``pp_size`` on ``backend`` (see the module docstring).

    Args:
        backend: the rank's executor. depth: PPHandler depth. max_num_reqs: slots.
        sink: event sink of the PPHandler.
    """

    def __init__(self, backend: Any, rank: int, pp_size: int, depth: int, max_num_reqs: int,
                 sink: EventSink = NULL_SINK) -> None:
        self.backend, self.rank, self.pp_size = backend, rank, pp_size
        self.is_last = rank == pp_size - 1
        self.handler: PPHandler | None = None
        if not self.is_last:
            self.handler = PPHandler(depth, max_num_reqs, sink=sink, rank=rank)
        self._last_pos = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] last rank's own count

    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Run step ``out``; the StepResult on the last rank, None elsewhere."""
        b = self.backend
        b.begin_step(out)
        self._consume()
        if self.handler is not None:
            for f in out.freed:
                self.handler.on_slot_freed(f.slot, out.step)
        b.free_and_admit(out)
        for n in out.new_requests:   # mutant rank_local_skip's rank-local memory
            self._last_pos[n.slot] = n.max_seq_len - 1
        mask = need_sampled_mask(out)
        logits = self._forward(out) if out.num_rows else None
        result = None
        blocking = mutants.active("blocking_all_chunk_broadcast") and self.pp_size > 1
        if blocking and mask is None and out.num_rows:   # mutant: broadcast every step
            mask = np.zeros(out.num_rows, dtype=bool)
        if self.is_last:
            payload = b.sample(out, mask, logits)
            if out.num_rows:
                b.apply_sampled(out.step, sampled_idx_mapping(out, mask), payload)
            if mutants.active("rank_local_skip") and mask is not None and all(
                    out.start_positions[i] + out.num_scheduled_tokens[i] >=
                    self._last_pos[out.slots[i]] for i in np.nonzero(mask)[0]):
                mask = None   # mutant: "nobody needs the last token of a finished request"
            b.publish(out, mask, payload)
            result = b.result(out, payload)
        elif mask is None:
            self.handler.enqueue(out.step, out, None)
            b.skip_receive(out)
        elif blocking:   # mutant: posted and waited for at once, applied now
            handle = b.post_receive(out, mask)
            handle.wait()
            self.handler.enqueue(out.step, out, None)
            b.note_posted(out, mask)
            from ppstate.pp_handler import ConsumedEntry
            entry = ConsumedEntry(out.step, sampled_idx_mapping(out, mask), handle, mask)
            b.apply_sampled(out.step, entry.idx_mapping, b.received(entry))
        else:
            self.handler.enqueue(out.step, out, mask, b.post_receive(out, mask))
            b.note_posted(out, mask)
        b.end_step(out)
        return result

    def _consume(self) -> None:
        if self.handler is None:
            return
        entry = self.handler.consume()      # waits on the posted receive, if any
        if entry is not None:
            self.backend.apply_sampled(entry.step, entry.idx_mapping, self.backend.received(entry))

    def _forward(self, out: SchedulerOutput) -> Any:
        b = self.backend
        inputs = b.prepare_inputs(out)
        received = b.receive(out) if self.rank > 0 else None
        hidden = b.forward(out, inputs, received)
        if not self.is_last:
            b.send(out, hidden)
        b.apply_scheduled(out)
        return hidden
