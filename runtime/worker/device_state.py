"""Device-side per-slot state of one rank, plus its CPU mirrors and the KV block table.

All tensors are indexed by slot (``req_idx``) and allocated once. The post-update kernels
(:mod:`runtime.worker.kernels.post_update`) are the only writers after admission: the immediate phase
(+query length after the forward, every rank) and the sampled phase (last rank right after
sampling, other ranks on the deferred consume ``pp_size`` steps later).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ppstate.batch import NewRequest, SchedulerOutput
from ppstate.block_digest import check_row_digests, rank_deltas
from ppstate.mirror import MIRROR_FIELDS, CpuMirror
from runtime.host_copy import to_device
from runtime.sampling.sampling_state import SamplingState
from runtime.sampling_params import SamplingParams
from runtime.worker import state_check
from runtime.worker.token_check import TokenMirror
from runtime.worker.kernels.post_update import post_update_computed, post_update_sampled


class DeviceState:
    """Slot-indexed tensors on ``device`` and the matching :class:`CpuMirror`.

    Args:
        max_num_reqs: slots.
        max_model_len: tokens per slot in ``all_token_ids``.
        width: sampled ids per row in the broadcast (1 + speculative tokens; 1 now).
        device: compute device.
        rank: PP rank (named in mirror divergences).
        block_size: tokens per KV block; the block table has ``ceil(max_model_len / block_size)``
            columns per slot.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, width: int, device: torch.device,
                 rank: int, block_size: int = 16) -> None:
        self.device, self.width, self.max_model_len, self.rank = device, width, max_model_len, rank
        self.block_size = block_size
        cols = -(-max_model_len // block_size)
        # Block table: the CPU copy feeds the step metadata (no device sync); the device copy is
        # what kernels read. Both change only through apply_block_updates / add_requests.
        self.block_table_np = np.zeros((max_num_reqs, cols), dtype=np.int32)  # [max_num_reqs, cols]
        self.block_table = torch.zeros(max_num_reqs, cols, dtype=torch.int32, device=device)
        self.output_offset_np = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] outputs prefilled
        i64 = dict(dtype=torch.int64, device=device)
        # The mirrored counters (MIRROR_FIELDS order, as CpuMirror.values) and total_len are rows
        # of one buffer, so a check reads them with one copy (no stack): [F + 1, max_num_reqs]
        self.fields = torch.zeros(len(MIRROR_FIELDS) + 1, max_num_reqs, **i64)
        for i, f in enumerate(MIRROR_FIELDS):   # num_computed_tokens, ..., num_blocks: views
            setattr(self, f, self.fields[i])                                   # [max_num_reqs]
        self.total_len = self.fields[len(MIRROR_FIELDS)]                       # [max_num_reqs]
        self.total_len_np = np.zeros(max_num_reqs, dtype=np.int64)  # [max_num_reqs] host copy
        self.last_sampled_tokens = torch.zeros(max_num_reqs, width, **i64)     # [max_num_reqs, width]
        self.all_token_ids = torch.zeros(max_num_reqs, max_model_len, **i64)   # [max_num_reqs, max_model_len]
        self.mirror = CpuMirror(max_num_reqs, rank=rank)
        self.owner: list[str | None] = [None] * max_num_reqs                    # [max_num_reqs]
        self.live_np = np.zeros(max_num_reqs, dtype=bool)                       # [max_num_reqs]
        self.live_version = 0   # +1 at every change of live_np / owner (add_requests, free)
        self.sampling_state = SamplingState(max_num_reqs, device)  # per-slot sampling parameters
        self.tokens: TokenMirror | None = None   # host copy of all_token_ids (track_tokens)
        # the host copies above, moved into one array in the mirror check's flat layout
        # [flat_size(max_num_reqs, cols)] int32 (state_check.bind_host_layout)
        self.host_flat = state_check.bind_host_layout(self)

    def track_tokens(self) -> TokenMirror:
        """Keep an exact host copy of ``all_token_ids`` from now on (the mirror checks compare
        it, docs/mirror_audit.md); starts from the device's ids."""
        if self.tokens is None:
            self.tokens = TokenMirror(*self.all_token_ids.shape, self.device)
        self.tokens.resync(self.all_token_ids)
        return self.tokens

    def add_requests(self, new: Sequence[NewRequest]) -> None:
        """Initialise the slots of newly admitted requests (prompt ids, lengths, counters,
        sampling parameters)."""
        for req in new:
            s, n = req.slot, len(req.prompt_token_ids)
            self.all_token_ids[s, :n] = to_device(torch.tensor(req.prompt_token_ids, dtype=torch.int64),
                                                  self.device)
            self.total_len[s] = n
            self.total_len_np[s] = n
            self.prefill_len[s] = n
            self.max_seq_len[s] = req.max_seq_len
            self.num_computed_tokens[s] = req.num_cached_tokens
            self.num_computed_prefill_tokens[s] = req.num_cached_tokens
            self.owner[s] = req.req_id
            self.live_np[s] = True
            self.live_version += 1
            self.block_table_np[s] = 0
            self.block_table[s] = 0
            self.num_blocks[s] = 0
            self.output_offset_np[s] = req.num_output_tokens
            if self.tokens is not None:
                self.tokens.admit(s, req.prompt_token_ids)
            self.mirror.add_request(s, n, req.max_seq_len, req.num_cached_tokens)
        if new:
            self.sampling_state.admit([r.slot for r in new],
                                      [SamplingParams(**r.sampling) for r in new],
                                      [len(r.prompt_token_ids) - r.num_output_tokens for r in new])

    def apply_block_updates(self, slots: np.ndarray, cols: np.ndarray, ids: np.ndarray) -> None:
        """Scheduler block-table deltas (``[U]`` each): ``block_table[slot, col] = id`` on the CPU
        copy and the device, ``num_blocks[slot] = max(num_blocks[slot], col + 1)`` on device and
        mirror."""
        if slots.size == 0:
            return
        ids = rank_deltas(self.rank, slots, ids)   # ids itself (a mutant hook of the checker)
        self.block_table_np[slots, cols] = ids
        s = to_device(slots, self.device, torch.int64)
        c = to_device(cols, self.device, torch.int64)
        self.block_table[s, c] = to_device(ids, self.device, torch.int32)
        self.num_blocks.scatter_reduce_(0, s, c + 1, reduce="amax")
        self.mirror.apply_block_updates(slots, cols)

    def check_block_digests(self, out: SchedulerOutput) -> None:
        """Before the forward: the host block-table rows of the step's slots (what the step's
        metadata is built from) against the scheduler's digests (``out.block_digests``).

        Raises:
            MirrorDivergence: field ``block_ids (digest vs scheduler)``, naming rank, step, slot
                and request.
        """
        check_row_digests(self.block_table_np, self.mirror.num_blocks_np, out.slots,
                          out.block_digests, out.step, self.rank, self.owner)

    def free(self, slot: int) -> None:
        """Forget the slot's owner (its tensors are re-initialised on the next admission)."""
        self.owner[slot] = None
        self.live_np[slot] = False
        self.live_version += 1

    def input_ids(self, token_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Gather the step's input token ids from device state: ``[num_tokens]`` int64.

        Args:
            token_slots, positions: ``[num_tokens]`` slot and absolute position of each token.

        Prefill rows read prompt ids, decode rows read the last sampled token, both from
        ``all_token_ids[slot, position]`` (written by the post-update kernels, never by the engine).
        """
        return self.all_token_ids[token_slots, positions]

    def apply_scheduled(self, slots: torch.Tensor, num_scheduled_tokens: torch.Tensor,
                        slots_np: np.ndarray, num_scheduled_tokens_np: np.ndarray) -> None:
        """Immediate phase after the forward: device kernel + mirror (+query length)."""
        post_update_computed(slots, num_scheduled_tokens, self.num_computed_tokens,
                             self.num_computed_prefill_tokens, self.prefill_len)
        self.mirror.apply_scheduled(slots_np, num_scheduled_tokens_np)

    def apply_sampled(self, idx_mapping: torch.Tensor, sampled: torch.Tensor,
                      num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                      idx_mapping_np: np.ndarray, num_rejected_np: np.ndarray,
                      num_sampled_np: np.ndarray, tokens_later: bool = False) -> None:
        """Sampled phase: write ids, advance ``total_len``, subtract rejected; ``-1`` rows skipped
        (``*_np``: ``[num_rows]`` host copies of the row arrays; ``num_sampled_np`` advances the
        host copy of ``total_len``). ``tokens_later``: the token mirror makes no copy of
        ``sampled``; the caller attaches its own host copy (``TokenMirror.record(later=True)``)."""
        post_update_sampled(idx_mapping, sampled.contiguous(), num_sampled.contiguous(),
                            num_rejected.contiguous(),
                            self.last_sampled_tokens, self.all_token_ids, self.total_len,
                            self.num_computed_tokens)
        self.mirror.apply_rejected(idx_mapping_np, num_rejected_np)
        keep = idx_mapping_np >= 0
        if self.tokens is not None:   # the ids land in the host copy once copied
            start = (self.total_len_np.take(idx_mapping_np)   # every row has a slot (decode)
                     if np.count_nonzero(keep) == keep.size
                     else self.total_len_np[np.where(keep, idx_mapping_np, 0)])
            if tokens_later:
                self.tokens.record(sampled, idx_mapping_np, start, num_sampled_np, later=True)
            else:
                self.tokens.record(sampled, idx_mapping_np, start, num_sampled_np)
        self.total_len_np[idx_mapping_np[keep]] += num_sampled_np[keep]   # a step's slots are distinct

    def live_slots(self) -> np.ndarray:
        """``[num_live]`` slots that hold a request."""
        return np.flatnonzero(self.live_np)

    def validate(self, step: int) -> None:
        """Compare mirrors with device tensors on live slots (invariant 4), and the block count
        of each live slot with what its computed tokens need (invariant 9).

        Raises:
            MirrorDivergence: naming rank, step, slot, request, field and both values.
        """
        live = self.live_slots()
        if live.size == 0:
            return
        if self.device.type == "cpu":   # the tensors are host memory: compare them in place
            self.mirror.validate(self.fields.numpy()[:-1], live, step, owners=self.owner)
        else:
            dev = self.fields[:-1].cpu().numpy()                               # [F, max_num_reqs]
            self.mirror.validate(dev, live, step, owners=self.owner)
        self.mirror.validate_blocks(self.block_size, live, step, owners=self.owner,
                                    spec_slack=2 * (self.width - 1))  # drafts' blocks (#14)
        state_check.check_now(self, live, step)
        if self.tokens is not None:
            self.check_tokens_now(live, step)

    def check_tokens_now(self, live: np.ndarray, step: int) -> None:
        """``all_token_ids`` of the live slots against the host copy, positions below the
        longest live ``total_len`` (what a step may read; the whole rows when that is at least a
        sixth of them, one contiguous comparison): in place on the CPU, else one read.

        Raises:
            MirrorDivergence: field ``all_token_ids[p]``, naming the first divergent slot.
        """
        t = int(self.total_len_np[live].max())
        if 6 * t > self.max_model_len:   # whole rows: contiguous, about 6x cheaper per element
            t = self.max_model_len
        dev = self.all_token_ids[:, :t]
        dev = dev.numpy() if self.device.type == "cpu" else dev.cpu().numpy()
        host = self.tokens.ids_np[:, :t]
        if np.array_equal(dev, host):   # every slot's row: no gather of the live rows
            return
        d, h = dev[live], host[live]
        if np.array_equal(d, h):
            return
        i, p = (int(x) for x in np.argwhere(d != h)[0])
        state_check._raise(step, self.rank, self.owner, int(live[i]), f"all_token_ids[{p}]",
                           h[i, p], d[i, p])

    def corrupt(self, slot: int, field: str, delta: int) -> None:
        """Test hook: add ``delta`` to one slot's entry of ``field`` (its whole row for a table)
        on one side only, to plant a divergence. ``field`` is an attribute of this state
        (``num_computed_tokens``, ``total_len``, ``block_table`` (device), ``block_table_np`` (the
        host table the step reads), ...) or of its sampling state (``sampling_state.f32``,
        ``sampling_state.i64``; fp32 values change by ``delta``).

        Raises:
            AttributeError: unknown field.
        """
        obj = self
        for part in field.split(".")[:-1]:
            obj = getattr(obj, part)
        getattr(obj, field.split(".")[-1])[slot] += delta
