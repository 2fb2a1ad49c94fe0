"""The last rank's structured-output hooks: where :class:`~runtime.sampling.grammar_state.GrammarState`
meets the step of :class:`~runtime.worker.runner.StageRunner` (docs/structured.md).

Order inside one step of the last rank (the runner calls these in this order):

1. ``admit`` (free / admit phase): freed slots drop their matcher; admitted constrained requests
   start one (rebuilt over their output tokens after a preemption).
2. ``start_fill`` (end of ``prepare_inputs``, before the forward): the bitmask of the step's
   constrained rows is filled in a background thread while the forward runs.
3. ``mask`` (start of ``sample``): the refused logits become ``-inf``.
4. ``accept_*`` (after sampling / verify): each constrained row's emitted tokens advance its matcher.
5. ``validate`` (with the mirrors): the accepted count of every constrained slot equals its
   output tokens.

Nothing here runs on a rank that is not the last, and nothing at all until the first constrained
request arrives (xgrammar and the tokenizer's vocabulary are loaded then, once).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from ppstate import mutants
from ppstate.batch import SchedulerOutput
from ppstate.pp_handler import need_sampled_mask
from runtime.sampling.grammar_state import GrammarFill, GrammarState


class GrammarHooks:
    """Lazily built :class:`GrammarState` of the last rank and the step hooks around it.

    Args:
        factory: builds the GrammarState (loads xgrammar and the vocabulary) on first use.
    """

    def __init__(self, factory: Callable[[], GrammarState]) -> None:
        self._factory = factory
        self._building: Future | None = None
        self.state: GrammarState | None = None
        self.fill: GrammarFill | None = None    # the step being run

    def warm(self) -> None:
        """Start building the GrammarState in a background thread (the engine asks for it when
        its first structured-output request arrives, so no step waits for xgrammar to load)."""
        if self._building is None:
            self._building = ThreadPoolExecutor(1, thread_name_prefix="grammar-warm").submit(self._factory)

    def _built(self) -> GrammarState:
        self.warm()
        self.state = self._building.result()
        return self.state

    def admit(self, out: SchedulerOutput) -> None:
        g = self.state
        if g is not None:
            for f in out.freed:
                g.free(f.slot)
        for r in out.new_requests:
            spec = r.sampling.get("structured") if isinstance(r.sampling, dict) else None
            if g is not None:
                g.free(r.slot)       # a slot reused without a freed entry (preempted earlier)
            if spec:
                if g is None:
                    g = self._built()
                n_out = r.num_output_tokens
                outputs = list(r.prompt_token_ids[len(r.prompt_token_ids) - n_out:]) if n_out else []
                g.admit(r.slot, spec, outputs)

    def start_fill(self, out: SchedulerOutput, spec_rows=None, first: np.ndarray | None = None) -> None:
        """Start the step's bitmask. ``spec_rows`` / ``first``: the speculative layout
        (:class:`~runtime.sampling.speculative_verify.SpecRows`, ``[R]`` first logit row), or None."""
        self.fill = None
        g = self.state
        if g is None or out.num_rows == 0 or not g.any_active(out.slots):
            return
        mask = need_sampled_mask(out)
        if mask is None:
            return
        rows = []
        for i in np.flatnonzero(mask):
            slot = int(out.slots[i])
            if spec_rows is None:
                rows.append((slot, int(i), []))
            else:
                k = int(spec_rows.num_drafts[i])
                rows.append((slot, int(first[i]), spec_rows.drafts[i, :k].tolist() if k else []))
        n = out.num_rows if first is None else int(first[-1] + spec_rows.num_drafts[-1] + 1)
        self.fill = g.start_fill(n, rows)

    def mask(self, logits: torch.Tensor) -> None:
        """Apply the step's bitmask to ``logits`` ``[N, V]`` in place (no-op without one)."""
        if self.fill is not None:
            self.state.apply(logits, self.fill)

    def accept_plain(self, slots: np.ndarray, token_ids: torch.Tensor) -> None:
        """One token per sampled row: ``slots`` ``[S]``, ``token_ids`` ``[S]`` (any device)."""
        g = self.state
        if g is None or not g.any_active(slots):
            return
        active = np.flatnonzero(g.active_np[slots])
        ids = token_ids.reshape(-1)[torch.as_tensor(active, device=token_ids.device)].tolist()
        g.accept_batch(slots[active].tolist(), ids)

    def accept_spec(self, slots: np.ndarray, token_ids: np.ndarray, num_sampled: np.ndarray) -> None:
        """Verified rows: ``token_ids`` ``[S, K + 1]``, of which the first ``num_sampled[i]``
        are emitted. The mutant ``grammar_on_rejected`` feeds every verified position instead."""
        g = self.state
        if g is None or not g.any_active(slots):
            return
        feed_all = mutants.active("grammar_on_rejected")
        for j in np.flatnonzero(g.active_np[slots]):
            n = token_ids.shape[1] if feed_all else int(num_sampled[j])
            g.accept(int(slots[j]), token_ids[j, :n].tolist())

    def validate(self, state, step: int, rank: int) -> None:
        """The mirrored field: accepted tokens == output tokens on every constrained slot."""
        g = self.state
        if g is None:
            return
        live = state.live_slots()
        if not g.any_active(live):
            return
        outputs = (state.total_len - state.prefill_len).cpu().numpy() + state.output_offset_np
        g.validate(outputs, live, step, state.owner, rank)
