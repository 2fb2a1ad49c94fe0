"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` + ``logprobs``), computed on the
last rank while the prompt is prefilled, chunk by chunk.

The logits at position ``p`` of a prompt predict the token at ``p + 1``, so a prefill row that
computes positions ``[start, start + n)`` of a request asking for prompt logprobs yields the
logprobs of prompt tokens ``start + 1 .. min(start + n, prompt_len - 1)``; the first prompt token
has none. Such rows get logits at every token instead of the last only: the step's logit index
(``BatchMeta.last_token``) is widened to ``[E]`` entries (every token of those rows, the last token
of the others) and :meth:`PromptLogprobPlan.split` takes the rows' last-token logits back for the
sampler. Everything is vectorised (numpy for the plan, one ``log_softmax`` / ``gather`` / ``topk``
on the device for all positions); the arrays reach the host when the step's result is built.

Requests asking for prompt logprobs skip prefix-cache hits (``RequestSpec.prefix_cache`` False):
a cached position computes no logits. A request recomputed after a preemption produces its
prompt entries again; the engine keeps the first of each position.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.host_copy import to_device
from runtime.sampling.step_logprobs import PromptLogprobs


class PromptLogprobTable:
    """Per slot: prompt logprob alternatives asked for (-1: none) and the prompt length (host).

    Args:
        max_num_reqs: slots.
    """

    def __init__(self, max_num_reqs: int) -> None:
        self.ks_np = np.full(max_num_reqs, -1, dtype=np.int64)         # [max_num_reqs]
        self.prompt_len_np = np.zeros(max_num_reqs, dtype=np.int64)    # [max_num_reqs] tokens

    def admit(self, slots, params, prompt_lens) -> None:
        """Record newly admitted requests (``params[i].prompt_logprobs``: None or 0 .. 20)."""
        s = np.asarray(slots, dtype=np.int64)
        self.ks_np[s] = [-1 if getattr(p, "prompt_logprobs", None) is None else p.prompt_logprobs
                         for p in params]
        self.prompt_len_np[s] = prompt_lens

    def plan(self, slots: np.ndarray, starts: np.ndarray,
             num_tokens: np.ndarray) -> "PromptLogprobPlan | None":
        """The widened logit index of one step, or None when no row scores prompt tokens.

        Args:
            slots, starts, num_tokens: ``[R]`` each row's slot, first position and query length.
        """
        ks = self.ks_np[slots]
        if ks.max(initial=-1) < 0:   # the common step: nobody asks (two numpy calls)
            return None
        plen = self.prompt_len_np[slots]
        scored = np.where(ks >= 0, np.clip(np.minimum(starts + num_tokens, plen - 1) - starts, 0, None), 0)
        if not scored.any():
            return None
        return PromptLogprobPlan(slots, starts, num_tokens, scored, ks)


class PromptLogprobPlan:
    """One step's widened logit index and which of its entries score prompt tokens.

    Args:
        slots, starts, num_tokens: ``[R]`` int64 of the step's rows.
        scored: ``[R]`` prompt tokens each row scores (0 for most rows).
        ks: ``[R]`` alternatives each row asked for (-1: none).
    """

    def __init__(self, slots: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray,
                 scored: np.ndarray, ks: np.ndarray) -> None:
        wide = scored > 0
        per_row = np.where(wide, num_tokens, 1)                         # [R] logit entries per row
        first_tok = np.cumsum(num_tokens) - num_tokens                  # [R] row's first index in T
        ext_start = np.cumsum(per_row) - per_row                        # [R] row's first entry in E
        self.last_in_ext = ext_start + per_row - 1                      # [R]
        # [E] index into T: every token of the wide rows, the last token of the others
        seg = np.repeat(np.arange(len(per_row)), per_row)
        within = np.arange(int(per_row.sum())) - np.repeat(ext_start, per_row)
        self.index = np.where(wide[seg], first_tok[seg] + within, first_tok[seg] + num_tokens[seg] - 1)
        # the scoring entries: the first `scored` entries of each wide row
        s_seg = np.repeat(np.arange(len(scored)), scored)
        s_within = np.arange(int(scored.sum())) - np.repeat(np.cumsum(scored) - scored, scored)
        self.score_entries = ext_start[s_seg] + s_within                # [P] into E
        self.rows = s_seg.astype(np.int32)                              # [P]
        self.positions = (starts[s_seg] + s_within + 1).astype(np.int32)   # [P] scored position
        self.slots = slots[s_seg]                                       # [P]
        self.ks = ks[s_seg].astype(np.int32)                            # [P]

    def split(self, logits: torch.Tensor, all_token_ids: torch.Tensor) -> tuple[torch.Tensor, "PendingPrompt"]:
        """``(row logits [R, V], pending entries)`` from the widened logits ``[E, V]``.

        Args:
            all_token_ids: ``[max_num_reqs, max_model_len]`` int64 the slots' token ids (the
                scored prompt tokens are read there, on the device).
        """
        dev = logits.device
        rows = logits.index_select(0, to_device(self.last_in_ext.astype(np.int64), dev))
        sel = logits.index_select(0, to_device(self.score_entries.astype(np.int64), dev)).float()
        lp = sel.log_softmax(dim=-1)                                     # [P, V]
        tok = all_token_ids[to_device(self.slots.astype(np.int64), dev),
                            to_device(self.positions.astype(np.int64), dev)]   # [P]
        tok_lp = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        k = int(self.ks.max())
        top = lp.topk(k, dim=-1) if k > 0 else None
        return rows, PendingPrompt(self, tok, tok_lp, top)


class PendingPrompt:
    """A step's prompt logprobs still on the device; :meth:`host` copies them once."""

    def __init__(self, plan: PromptLogprobPlan, tok: torch.Tensor, tok_lp: torch.Tensor, top) -> None:
        self.plan, self.tok, self.tok_lp, self.top = plan, tok, tok_lp, top

    def host(self) -> PromptLogprobs:
        """The entries as :class:`PromptLogprobs` (one device-to-host copy per array)."""
        p = self.plan
        if self.top is None:
            ids = np.zeros((p.rows.size, 0), np.int64)
            vals = np.zeros((p.rows.size, 0), np.float32)
        else:
            vals = self.top.values.float().cpu().numpy()
            ids = self.top.indices.cpu().numpy().astype(np.int64)
        return PromptLogprobs(p.rows, p.positions, self.tok.cpu().numpy().astype(np.int64),
                              self.tok_lp.float().cpu().numpy(), p.ks, ids, vals)
