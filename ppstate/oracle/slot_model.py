"""The slot model of a simulated rank, shared by the simulator's ``SimRank`` and the model
checker's ``CheckRank``: who owns each slot, the token ids each slot's request has produced, and
what the reference model (:func:`ppstate.oracle.model.model_token`) needs to sample the next one.

Both backends admit, free and read input tokens through this one class, so the two tools model a
rank's per-slot token state alike; each keeps its own device counters and mirrors beside it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ppstate.batch import SchedulerOutput

#: ``check_owner(step, slot, want, have)``: ownership before a free (``want`` = the freed
#: request) or an admission (``want`` = None); records a violation (invariant 2) when they differ
OwnerCheck = Callable[[int, int, "str | None", "str | None"], None]


class SlotTokens:
    """Per-slot token state of one rank.

    Args:
        max_num_reqs: slots.

    Attributes:
        owner: ``[max_num_reqs]`` request id holding the slot, or None.
        history: ``[max_num_reqs]`` lists of the output token ids the slot's request has (the
            kept outputs of a re-admission, then each sampled id as it is applied).
        sample_seed: ``[max_num_reqs]`` int64 seed of the token model (``sampling["seed"]``).
        last_prompt: ``[max_num_reqs]`` int64 last prompt token id (the first decode input).
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.owner: list[str | None] = [None] * max_num_reqs               # [max_num_reqs]
        self.history: list[list[int]] = [[] for _ in range(max_num_reqs)]  # [max_num_reqs]
        self.sample_seed = np.zeros(max_num_reqs, dtype=np.int64)          # [max_num_reqs]
        self.last_prompt = np.zeros(max_num_reqs, dtype=np.int64)          # [max_num_reqs]

    def free_and_admit(self, out: SchedulerOutput, check_owner: OwnerCheck) -> None:
        """Free ``out.freed`` and admit ``out.new_requests`` (each after ``check_owner``); a
        re-admitted request's history starts with its kept outputs (the tail of its prefill)."""
        for f in out.freed:
            check_owner(out.step, f.slot, f.req_id, self.owner[f.slot])
            self.owner[f.slot] = None
        for n in out.new_requests:
            check_owner(out.step, n.slot, None, self.owner[n.slot])
            s, kept = n.slot, n.num_output_tokens
            self.owner[s] = n.req_id
            self.history[s] = list(n.prompt_token_ids[len(n.prompt_token_ids) - kept:])
            self.sample_seed[s] = n.sampling["seed"]
            self.last_prompt[s] = n.prompt_token_ids[-1]

    def input_tokens(self, out: SchedulerOutput) -> np.ndarray:
        """Rank 0's input token of each row ``[num_rows]``: the slot's last output id (or last
        prompt id) for rows that sample, -1 for non-final chunks. It travels to the last rank
        inside the "hidden states" and conditions the sampled token."""
        toks = np.full(out.num_rows, -1, dtype=np.int64)    # [num_rows]
        for i in np.nonzero(out.is_final_chunk)[0].tolist():
            slot = int(out.slots[i])
            hist = self.history[slot]
            toks[i] = hist[-1] if hist else int(self.last_prompt[slot])
        return toks

    def live_slots(self) -> np.ndarray:
        """``[num_live]`` int64 slots with an owner, ascending."""
        return np.array([i for i, o in enumerate(self.owner) if o is not None], dtype=np.int64)
