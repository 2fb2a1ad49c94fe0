"""The model checker's rank: device state, communication and sampling of one PP rank.

A :class:`CheckRank` owns the real :class:`~ppstate.pp_handler.PPHandler` (non-last ranks,
overlapped mode) and :class:`~ppstate.mirror.CpuMirror`, plus a numpy stand-in of the device
per-slot counters that follows the post-update kernels' rules (immediate phase: ``+`` query length
after the forward; sampled phase: ``-`` rejected tokens). Communication goes through
:class:`~ppstate.check.comm.Comm`; a wait that cannot complete raises
:class:`~ppstate.check.comm.Blocked`, and the world re-runs the step from its start later with the
ops already issued (:attr:`CheckRank.oplog`) answered from the log instead of issued again.

Sampling is the checker's choice: each row that needs a sample yields the deterministic "model"
token (:func:`ppstate.oracle.model.model_token`) or EOS, and with ``spec_tokens = K`` each decode
row reports 0..K rejected speculative tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ppstate import mutants
from ppstate.batch import SchedulerOutput
from ppstate.block_digest import check_row_digests, rank_deltas
from ppstate.check.backend import BackendMethods
from ppstate.check.comm import Blocked, Op
from ppstate.errors import MirrorDivergence
from ppstate.events import EventSink
from ppstate.mirror import MIRROR_FIELDS, CpuMirror
from ppstate.pp_handler import PPHandler
from ppstate.rank_step import RankStep
from ppstate.oracle.model import EOS_TOKEN, model_token
from ppstate.oracle.slot_model import SlotTokens



class CheckRank(BackendMethods):
    """Rank ``rank`` of ``pp_size`` in the model checker: a backend of the shared step order
    (:class:`~ppstate.rank_step.RankStep`, in :attr:`stepper`).

    Args:
        rank, pp_size: position in the pipeline.
        overlapped: deferred consume (depth ``pp_size``) or sync mode (blocking broadcast).
        max_num_reqs: slots.
        sink: the rank's event sink (trace + monitor).
        blocks_per_slot: columns of the block table (``ceil(max_model_len / block_size)``).
    """

    def __init__(self, rank: int, pp_size: int, overlapped: bool, max_num_reqs: int,
                 sink: EventSink, blocks_per_slot: int = 1) -> None:
        self.rank, self.pp_size, self.overlapped = rank, pp_size, overlapped
        self.is_first, self.is_last = rank == 0, rank == pp_size - 1
        self.depth = pp_size if overlapped else 1
        self.sink = sink
        self.step_order = RankStep(self, rank, pp_size, self.depth, max_num_reqs, sink=sink)
        self.handler: PPHandler | None = self.step_order.handler
        self.mirror = CpuMirror(max_num_reqs, rank=rank)
        i64 = dict(dtype=np.int64)
        self.device = {f: np.zeros(max_num_reqs, **i64) for f in MIRROR_FIELDS}  # [max_num_reqs] each
        self.slot_tokens = SlotTokens(max_num_reqs)   # owners, token histories (shared model)
        # block table built from the scheduler's deltas (ids: ppstate/check/block_ids.py)
        self.block_table = np.zeros((max_num_reqs, blocks_per_slot), **i64)  # [max_num_reqs, cols]
        self.block_error: str | None = None   # block-id disagreement of the step in progress
        self.output_cap = np.zeros(max_num_reqs, **i64)   # [max_num_reqs] outputs allowed
        self.ignore_eos = np.zeros(max_num_reqs, dtype=bool)  # [max_num_reqs]
        self.stopped = np.zeros(max_num_reqs, dtype=bool)  # [max_num_reqs] EOS sampled (last rank)
        # --grammar: the last rank's matcher position of each slot (tokens it accepted)
        self.grammar_pos = np.zeros(max_num_reqs, **i64)   # [max_num_reqs]
        self.running_step = -1   # the step of the attempt in progress (-1 between attempts)
        self.oplog: list[Op] = []      # ops issued by the step in progress (resumed after a block)
        self.choice_log: list[int] = []  # choices taken by the step in progress
        self.blocked_on: Op | None = None  # the op the step in progress waits for
        self._cursor = self._choice_cursor = 0
        self.world: Any = None  # the ppstate.check.world.World running this rank (no import: no cycle)

    @property
    def next_step(self) -> int:
        """The number after the last step this rank ran (its step order's
        :attr:`~ppstate.rank_step.RankStep.next_step`); it runs the first issued step from it."""
        return self.step_order.next_step

    @next_step.setter
    def next_step(self, value: int) -> None:   # the canonical form's step shift
        self.step_order.next_step = value

    def begin_attempt(self, step: int) -> None:
        """(Re-)start step ``step``: logged ops and choices are answered from the logs."""
        self.running_step = step
        self._cursor = self._choice_cursor = 0

    def finish_step(self) -> None:
        """The step completed (the step order advanced :attr:`next_step`): the next one starts
        with empty logs."""
        self.oplog, self.choice_log, self.blocked_on = [], [], None
        self.running_step = -1

    def choose(self, n: int) -> int:
        """A choice of the explorer in ``range(n)``; the same one when the step is re-run."""
        if self._choice_cursor < len(self.choice_log):
            c = self.choice_log[self._choice_cursor]
        else:
            c = self.world.chooser.choose(n)
            self.choice_log.append(c)
        self._choice_cursor += 1
        return c

    # ---------------------------------------------------------------- communication
    def _issue(self, group: str, kind: str, step: int, peer: int = -1, payload: Any = None,
               is_root: bool = False) -> Op:
        """Issue an op, or return the one this step already issued (re-run after a block)."""
        if self._cursor < len(self.oplog):
            op = self.oplog[self._cursor]
            assert (op.group, op.kind, op.step) == (group, kind, step), "step re-run diverged"
        else:
            op = self.world.comm.issue(group, kind, self.rank, step, peer, payload, is_root)
            self.oplog.append(op)
        self._cursor += 1
        return op

    def wait(self, op: Op) -> Any:
        """Blocking wait on ``op``; raises :class:`Blocked` while it cannot complete."""
        self.world.monitor.on_wait(self, op)
        if not op.done:
            raise Blocked(op)
        return op.payload

    def send_next(self, step: int, hidden: np.ndarray) -> None:
        """Non-blocking p2p send of the step's hidden states to rank + 1 (pp group)."""
        self._issue("pp", "send", step, self.rank + 1, hidden)

    def recv_prev(self, step: int) -> np.ndarray:
        """Blocking p2p receive from rank - 1 (pp group)."""
        return self.wait(self._issue("pp", "recv", step, self.rank - 1))

    def post_broadcast(self, step: int, payload: Any, root: bool, group: str = "bcast") -> Op:
        """Post this rank's side of step ``step``'s sampled-token broadcast (never blocks)."""
        return self._issue(group, "bcast", step, payload=payload, is_root=root)

    # ---------------------------------------------------------------- device state
    def apply_freed_new(self, out: SchedulerOutput) -> None:
        """Free and admit slots (the scheduler's ``freed`` / ``new_requests``), block deltas
        (the PPHandler generations were bumped by the step order already)."""
        self.slot_tokens.free_and_admit(out, self._check_owner)
        for n in out.new_requests:
            s, kept = n.slot, n.num_output_tokens
            self.output_cap[s] = n.max_seq_len - (len(n.prompt_token_ids) - kept)
            self.ignore_eos[s] = bool(n.sampling.get("ignore_eos", False))
            self.stopped[s] = False
            self.grammar_pos[s] = kept          # the matcher is rebuilt over the kept outputs
            for f, v in (("num_computed_tokens", n.num_cached_tokens),
                         ("num_computed_prefill_tokens", n.num_cached_tokens),
                         ("prefill_len", len(n.prompt_token_ids)),
                         ("max_seq_len", n.max_seq_len), ("num_blocks", 0)):
                self.device[f][s] = v
            self.mirror.add_request(s, len(n.prompt_token_ids), n.max_seq_len, n.num_cached_tokens)
            self.block_table[s] = 0
        if out.block_table_slots.size:
            s = out.block_table_slots.astype(np.int64)
            c = out.block_table_cols.astype(np.int64)
            self.block_table[s, c] = rank_deltas(self.rank, s, out.block_table_ids)  # mutant hook
            np.maximum.at(self.device["num_blocks"], s, c + 1)
            self.mirror.apply_block_updates(out.block_table_slots, out.block_table_cols)
        self.block_error = None
        try:   # block-id agreement before the forward (invariant 9), reported at validation
            check_row_digests(self.block_table, self.mirror.num_blocks_np, out.slots,
                              out.block_digests, out.step, self.rank, self.slot_tokens.owner)
        except MirrorDivergence as exc:
            self.block_error = str(exc)

    def apply_scheduled(self, out: SchedulerOutput) -> None:
        """Immediate phase after the forward: device (kernel rule) and mirror, ``+`` query length."""
        slots = out.slots.astype(np.int64)
        n = out.num_scheduled_tokens.astype(np.int64)
        d = self.device
        pre = np.maximum(d["prefill_len"][slots] - d["num_computed_prefill_tokens"][slots], 0)
        np.add.at(d["num_computed_prefill_tokens"], slots, np.minimum(n, pre))
        np.add.at(d["num_computed_tokens"], slots, n)
        self.mirror.apply_scheduled(slots, n)

    def apply_sampled_rows(self, idx: np.ndarray, token_ids: np.ndarray, num_sampled: np.ndarray,
                           num_rejected: np.ndarray, src: SchedulerOutput | None = None) -> None:
        """Sampled phase for rows ``idx >= 0``: append the ids to the slot's history, device
        ``num_computed_tokens -= rejected``, and the mirror's correction
        (:meth:`CpuMirror.apply_rejected`)."""
        for i, slot in enumerate(idx.tolist()):
            if slot < 0:
                continue
            if src is not None:
                self.world.monitor.check_apply(self, src.step, src.req_ids[i], slot)
            for k in range(int(num_sampled[i])):
                self.slot_tokens.history[slot].append(int(token_ids[i, k]))
            self.device["num_computed_tokens"][slot] -= int(num_rejected[i])
        self.mirror.apply_rejected(idx, num_rejected.astype(np.int64))

    # ---------------------------------------------------------------- model
    def _check_owner(self, step: int, slot: int, want: str | None, have: str | None) -> None:
        self.world.monitor.check_owner(self, step, slot, want)

    def sample_rows(self, out: SchedulerOutput, mask: np.ndarray | None, inputs: np.ndarray,
                    spec_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The last rank's sample: ``(token_ids [num_rows, 1], num_sampled [num_rows],
        num_rejected [num_rows])``; EOS and rejections are the checker's choices."""
        n = out.num_rows
        ids = np.zeros((n, 1), dtype=np.int64)
        num_sampled = np.zeros(n, dtype=np.int64)
        rejected = np.zeros(n, dtype=np.int64)
        rows = [] if mask is None else np.nonzero(mask)[0].tolist()
        for i in rows:
            slot = int(out.slots[i])
            index = len(self.slot_tokens.history[slot])
            branch = not self.stopped[slot] and not self.ignore_eos[slot] and \
                index < self.output_cap[slot]
            if branch and self.choose(2) == 1:
                tok = EOS_TOKEN
                self.stopped[slot] = True
            else:
                tok = model_token(int(self.slot_tokens.sample_seed[slot]), index, int(inputs[i]), -1)
            ids[i, 0], num_sampled[i] = tok, 1
            decode = int(out.start_positions[i]) >= int(self.mirror.prefill_len_np[slot])
            if spec_tokens and decode:
                rejected[i] = self.choose(spec_tokens + 1)
            if self.world.cfg.grammar:   # the matcher takes the emitted tokens only
                extra = rejected[i] if mutants.active("grammar_on_rejected") else 0
                self.grammar_pos[slot] += num_sampled[i] + extra
        return ids, num_sampled, rejected

    # ---------------------------------------------------------------- validation
    def validate(self, step: int, check_blocks: bool) -> None:
        """Block-id agreement of the step's rows (9, checked before the forward), mirror
        agreement (invariant 4) and KV completeness (8) on the live slots; a divergence
        is recorded as a ``mirror.check`` event with ``ok`` False (the monitor reports it)."""
        live, owner = self.slot_tokens.live_slots(), self.slot_tokens.owner
        values = self.mirror.num_computed_tokens_np[live].tolist()
        ok, message = True, None
        if self.block_error is not None:
            ok, message = False, self.block_error
        elif live.size:
            try:
                self.mirror.validate(self.device, live, step, owners=owner)
                if self.is_last and self.world.cfg.grammar:
                    self._validate_grammar(live, step)
                if check_blocks:
                    self.mirror.validate_blocks(self.world.block_size, live, step, owner)
            except Exception as exc:  # noqa: BLE001 - MirrorDivergence, reported as a violation
                ok, message = False, str(exc)
        self.sink.emit("mirror.check", step=step, rank=self.rank, slots=live.tolist(),
                       num_computed_tokens=values, ok=ok, message=message)

    def _validate_grammar(self, live: np.ndarray, step: int) -> None:
        """The grammar position of every live slot equals its accepted output tokens on this
        rank (the mirrored field of structured outputs). Raises MirrorDivergence."""
        for s in live.tolist():
            accepted = len(self.slot_tokens.history[s])
            if int(self.grammar_pos[s]) != accepted:
                raise MirrorDivergence(step=step, slot=s, req_id=self.slot_tokens.owner[s],
                                       field="grammar_position", cpu=int(self.grammar_pos[s]),
                                       device=accepted, rank=self.rank)
