"""Per-slot grammar matchers of the last rank: the token bitmask of each constrained row.

Structured outputs live where sampling happens, on the last rank (docs/structured.md):

* **admit**: a request with a :class:`~runtime.sampling_params.StructuredSpec` gets a matcher
  for its slot, compiled in this module's thread (cached per spec). A request re-admitted after
  preemption (its prompt now ends with its earlier output tokens) has its matcher rebuilt by
  accepting those output tokens again, so recompute resumes the grammar where it stopped.
* **fill** (:meth:`GrammarState.start_fill`): the step's bitmask ``[N, ceil(V / 32)]`` int32 is
  filled in the same background thread while the forward runs: one call of xgrammar's
  ``BatchGrammarMatcher`` for every row without drafts (``threads`` C++ threads, the GIL released;
  ``PPSTATE_GRAMMAR_THREADS`` overrides the default), into a pinned host buffer when CUDA is in use
  (copied to the device without blocking, one kernel masks every constrained row); with speculative drafts each of a row's
  ``1 + k`` logit rows gets the mask after the drafts before it (the matcher accepts the drafts
  tentatively and rolls them back at once; a draft the grammar refuses leaves the later rows
  unmasked: their samples are never emitted, since the refused draft cannot match the sample).
* **apply** (:meth:`GrammarState.apply`): masked logits are set to ``-inf`` in place before the
  sampler runs.
* **accept** (:meth:`GrammarState.accept`): only the tokens the step emits (after the verify of
  drafts) advance the matcher; ``num_accepted[slot]`` counts them. It is a mirrored field: on
  every validated step it must equal the slot's output tokens (:meth:`GrammarState.validate`).
* **free**: a finished, aborted or preempted request's matcher is dropped with its slot.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from runtime.sampling.grammar import GrammarCompilerCache, load_xgrammar


def _bit_row(token_ids: list[int], words: int) -> torch.Tensor:
    """``[words]`` int32 bitmask row allowing exactly ``token_ids``."""
    row = np.zeros(words, dtype=np.uint32)
    t = np.asarray(token_ids, dtype=np.int64)
    np.bitwise_or.at(row, t // 32, (np.uint32(1) << (t % 32).astype(np.uint32)))
    return torch.from_numpy(row.view(np.int32).copy())


def default_threads() -> int:
    """Threads of the batched bitmask fill: ``PPSTATE_GRAMMAR_THREADS``, else with CUDA in use
    half the host's cores (at most 8: the host is idle while the GPU runs the forward), without
    it a quarter (at most 4: the CPU forward keeps its cores), and at least 1."""
    env = os.environ.get("PPSTATE_GRAMMAR_THREADS")
    if env:
        return max(1, int(env))
    cores = os.cpu_count() or 1
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return max(1, min(8, cores // 2))
    return max(1, min(4, cores // 4))


class _HostBitmasks:
    """A ring of two host bitmask buffers ``[capacity, W]`` int32, pinned when CUDA is in use:
    the step after next reuses a buffer only once its copy to the device has finished (an event
    recorded after the copy)."""

    def __init__(self, words: int) -> None:
        self.words = words
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [None, None]
        self._turn = 0

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """The next buffer's first ``n`` rows (``[n, W]``, to be set) and its ring index."""
        i = self._turn = 1 - self._turn
        if self._events[i] is not None:
            self._events[i].synchronize()
            self._events[i] = None
        buf = self._bufs[i]
        if buf is None or buf.shape[0] < n:
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            buf = self._bufs[i] = torch.empty((max(n, 2 * (0 if buf is None else buf.shape[0])),
                                               self.words), dtype=torch.int32, pin_memory=pin)
        return i, buf[:n]

    def to_device(self, i: int, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``bitmask`` (buffer ``i``'s rows) on ``device``; a CUDA copy does not block the host."""
        if device.type != "cuda":
            return bitmask
        out = bitmask.to(device, non_blocking=bitmask.is_pinned())
        ev = torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return out


class GrammarViolation(RuntimeError):
    """An emitted token the slot's grammar refuses (the bitmask was not applied: a bug)."""


@dataclass
class GrammarFill:
    """A step's bitmask being filled: ``future`` gives the ``[N, W]`` int32 CPU bitmask
    (all ones on rows without a grammar); ``rows`` are the ``[G]`` logit rows it masks;
    ``buf``: its host buffer's ring index (-1: not a ring buffer)."""
    future: Future
    rows: list[int]
    buf: int = -1


class GrammarState:
    """Matchers, by slot, of one last rank.

    Args:
        cache: compiles specs for this model's tokenizer.
        max_num_reqs: slots.
        threads: C++ threads of the batched fill (:func:`default_threads` when None).
    """

    def __init__(self, cache: GrammarCompilerCache, max_num_reqs: int,
                 threads: int | None = None) -> None:
        self._xgr = load_xgrammar()
        self.cache = cache
        self.vocab_size = cache.vocab_size
        self.words = -(-self.vocab_size // 32)
        self._matchers: list[Any] = [None] * max_num_reqs           # [max_num_reqs] matcher | Future
        self.active_np = np.zeros(max_num_reqs, dtype=bool)           # [max_num_reqs]
        self.num_accepted = np.zeros(max_num_reqs, dtype=np.int64)    # [max_num_reqs] output tokens
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.threads = threads or default_threads()
        self._batch = self._xgr.BatchGrammarMatcher(self.threads)
        self._host = _HostBitmasks(self.words)
        self._stop_row = _bit_row(cache.info.stop_token_ids, self.words)   # [W] int32
        # JSON kinds: xgrammar lets raw control bytes (< 0x20) into strings, which JSON forbids
        # (RFC 8259 §7) and parsers refuse; with no free whitespace they are never valid there
        vocab = cache.info.decoded_vocab
        self._json_row = _bit_row([i for i, b in enumerate(vocab) if not any(c < 0x20 for c in b)]
                                  + list(cache.info.stop_token_ids), self.words)   # [W] int32
        self._json_np = np.zeros(max_num_reqs, dtype=bool)            # [max_num_reqs]

    # ---- slots ---------------------------------------------------------------------------------
    def admit(self, slot: int, spec: dict, output_ids: list[int]) -> None:
        """Start the matcher of ``slot`` for ``spec`` (``{"kind", "value"}``), rebuilt over the
        request's ``output_ids`` (recompute after preemption; empty for a new request)."""
        self.active_np[slot] = True
        self._json_np[slot] = spec["kind"] in ("json_schema", "json_object")
        self.num_accepted[slot] = len(output_ids)
        self._matchers[slot] = self._pool.submit(self._build, spec["kind"], spec.get("value", ""),
                                                 list(output_ids), slot)

    def _build(self, kind: str, value: str, output_ids: list[int], slot: int):
        m = self._xgr.GrammarMatcher(self.cache.compile(kind, value))
        for t in output_ids:
            if not m.is_terminated() and not m.accept_token(int(t)):
                raise GrammarViolation(f"slot {slot}: rebuilding its {kind} matcher, output token "
                                       f"{t} is refused")
        return m

    def free(self, slot: int) -> None:
        """Drop the slot's matcher (finished, aborted or preempted request)."""
        self._matchers[slot] = None
        self.active_np[slot] = False
        self.num_accepted[slot] = 0

    def matcher(self, slot: int):
        """The slot's matcher, waiting for its compile. Raises what the compile raised."""
        m = self._matchers[slot]
        if isinstance(m, Future):
            m = self._matchers[slot] = m.result()
        return m

    def any_active(self, slots: np.ndarray) -> bool:
        """Whether any of ``slots`` (``[R]`` int) has a grammar."""
        return bool(self.active_np[slots].any()) if len(slots) else False

    # ---- bitmask -------------------------------------------------------------------------------
    def start_fill(self, n_logit_rows: int, rows: list[tuple[int, int, list[int]]]) -> GrammarFill | None:
        """Fill the bitmask in the background (overlapping the forward).

        Args:
            n_logit_rows: ``N``, rows of the step's logits.
            rows: per constrained sampled row, ``(slot, first logit row, drafts)``: the row's
                ``1 + len(drafts)`` logit rows start at ``first``.
        Returns: the pending fill, or None when no row is constrained.
        """
        rows = [r for r in rows if self.active_np[r[0]]]
        if not rows:
            return None
        masked = [first + j for _, first, drafts in rows for j in range(1 + len(drafts))]
        i, bitmask = self._host.take(n_logit_rows)
        return GrammarFill(self._pool.submit(self._fill, bitmask, rows), masked, i)

    def _fill(self, bitmask: torch.Tensor, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Fill ``bitmask`` ``[N, W]``: all ones, then rows without drafts in one batched call,
        terminated rows with the stop row, rows with drafts one by one."""
        bitmask.fill_(-1)
        plain, plain_rows, stop_rows, json_rows = [], [], [], []
        drafted = []
        for slot, first, drafts in rows:
            m = self.matcher(slot)
            if drafts:
                drafted.append((slot, first, drafts))
            elif m.is_terminated():   # the grammar is complete: only a stop token may follow
                stop_rows.append(first)
            else:
                plain.append(m)
                plain_rows.append(first)
                if self._json_np[slot]:
                    json_rows.append(first)
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, plain_rows)
        if stop_rows:
            bitmask[stop_rows] = self._stop_row
        if json_rows:
            idx = torch.as_tensor(json_rows)
            bitmask[idx] = bitmask.index_select(0, idx) & self._json_row
        if drafted:
            self._fill_rowwise(bitmask, drafted)
        return bitmask

    def _fill_rowwise(self, bitmask: torch.Tensor, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Fill ``bitmask`` ``[N, W]`` row by row, each row's drafts accepted tentatively (the
        speculative path, and the reference of the batched fill)."""
        for slot, first, drafts in rows:
            m = self.matcher(slot)
            taken = 0
            for j in range(1 + len(drafts)):
                if m.is_terminated():   # the grammar is complete: only a stop token may follow
                    bitmask[first + j] = self._stop_row
                    break
                m.fill_next_token_bitmask(bitmask, first + j)
                if self._json_np[slot]:
                    bitmask[first + j] &= self._json_row
                if j == len(drafts) or not m.accept_token(int(drafts[j])):
                    break   # later rows stay all-ones: their samples are never emitted
                taken += 1
            if taken:
                m.rollback(taken)
        return bitmask

    def apply(self, logits: torch.Tensor, fill: GrammarFill) -> None:
        """Set the refused tokens' logits to ``-inf`` in place. ``logits``: ``[N, V']`` with
        ``V' >= V`` (columns past the tokenizer's vocabulary are refused too)."""
        host = fill.future.result()
        bitmask = self._host.to_device(fill.buf, host, logits.device) if fill.buf >= 0 \
            else host.to(logits.device)
        every = len(fill.rows) == logits.shape[0] and fill.rows == list(range(logits.shape[0]))
        if logits.shape[1] > self.vocab_size:
            logits[slice(None) if every else fill.rows, self.vocab_size:] = float("-inf")
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                              indices=None if every else fill.rows)

    def accept(self, slot: int, tokens: list[int]) -> None:
        """Advance the slot's matcher by the tokens the step emitted for it.

        Raises: GrammarViolation if the grammar refuses one (tokens after the grammar's end,
        only possible with ``ignore_eos``, are counted but not fed).
        """
        m = self.matcher(slot)
        for t in tokens:
            if not m.is_terminated() and not m.accept_token(int(t)):
                raise GrammarViolation(f"slot {slot}: emitted token {t} is refused by its grammar "
                                       f"after {self.num_accepted[slot]} accepted tokens")
            self.num_accepted[slot] += 1

    def accept_batch(self, slots: list[int], tokens: list[int]) -> None:
        """Advance each of ``slots`` (``[S]``, constrained) by one emitted token ``tokens[i]`` in
        one batched call. Raises: GrammarViolation naming the first slot whose grammar refuses."""
        ms = [self.matcher(s) for s in slots]
        live = [i for i, m in enumerate(ms) if not m.is_terminated()]
        ok = self._batch.batch_accept_token([ms[i] for i in live], [int(tokens[i]) for i in live])
        for i, good in zip(live, ok):
            if not good:
                s = slots[i]
                raise GrammarViolation(f"slot {s}: emitted token {tokens[i]} is refused by its "
                                       f"grammar after {self.num_accepted[s]} accepted tokens")
        self.num_accepted[np.asarray(slots, dtype=np.int64)] += 1

    # ---- mirrored field ------------------------------------------------------------------------
    def validate(self, output_tokens: np.ndarray, live: np.ndarray, step: int,
                 owners: list[str | None], rank: int | None = None) -> None:
        """Every live constrained slot's ``num_accepted`` equals its output tokens.

        Args: output_tokens: ``[max_num_reqs]`` output tokens of each slot on this rank;
            live: ``[L]`` live slots; owners: request id by slot (named in the error).
        Raises: MirrorDivergence naming the slot, the request and both values.
        """
        from ppstate.errors import MirrorDivergence
        s = live[self.active_np[live]]
        bad = s[self.num_accepted[s] != output_tokens[s]]
        if bad.size:
            b = int(bad[0])
            raise MirrorDivergence(step=step, slot=b, req_id=owners[b], field="grammar_num_accepted",
                                   cpu=int(self.num_accepted[b]), device=int(output_tokens[b]),
                                   rank=rank)

    def close(self) -> None:
        """Stop the thread (pending work is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
