"""One rank's greedy generation loop on the GPU fast path (paged Triton attention, CUDA graphs),
as the benchmark and the GPU tests drive it.

Per decode step the loop issues: the next step's KV write indices from the device block table
(``slot_mapping = block_table[pos // bs] * bs + pos % bs``, on the device), the captured graph (or
the eager forward), the argmax, and an async copy of the sampled ids into pinned host memory with
an event; the host reads step N's ids only after issuing step N+1 (the engine-facing wait is one
step behind), so the host never stalls the GPU. Prefill runs eagerly in chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from runtime.model.kernels.attention import choose_num_splits
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.worker.cuda_graphs import DecodeGraphs


@dataclass
class LaneState:
    """Device tensors of one batch (lane) of ``n`` rows between decode steps."""
    block_tables_np: np.ndarray                      # [n, MB] int32 block ids
    block_tables: torch.Tensor                       # [n, MB] int32
    positions: torch.Tensor                          # [n] int64 position of the next input token
    seq_lens: torch.Tensor                           # [n] int32 keys after the next step
    ids: torch.Tensor | None = None                  # [n] int64 next input token ids
    tokens: list = field(default_factory=list)       # host copies of sampled ids, per step

    def meta(self, block_size: int, num_kv_heads: int) -> PagedMeta:
        """Decode metadata of the next step, computed on the device (no host sync)."""
        n = self.positions.shape[0]
        blk = self.block_tables.gather(1, (self.positions // block_size)[:, None])[:, 0]
        slots = blk.long() * block_size + self.positions % block_size
        ar = torch.arange(n + 1, dtype=torch.int32, device=self.positions.device)
        return PagedMeta(self.positions, slots, self.block_tables, self.seq_lens, ar,
                         ar[:-1].long(), max_query_len=1,
                         num_splits=choose_num_splits(n, num_kv_heads, self.block_tables.shape[1] * block_size))

    def advance(self) -> None:
        self.positions = self.positions + 1
        self.seq_lens = self.seq_lens + 1


def make_lane(n: int, blocks_per_row: int, first_block: int, device, seed: int = 0) -> LaneState:
    """Rows get ``blocks_per_row`` blocks each from ``[first_block, first_block + n * bpr)``,
    shuffled (a paged cache, not a contiguous one)."""
    rng = np.random.default_rng(seed)
    bt = (first_block + rng.permutation(n * blocks_per_row)).reshape(n, blocks_per_row).astype(np.int32)
    z = torch.zeros(n, dtype=torch.int64, device=device)
    return LaneState(bt, torch.from_numpy(bt).to(device), z, z.to(torch.int32))


def prefill_chunks(lane: LaneState, prompts: np.ndarray, chunk_tokens: int, block_size: int,
                   kvh: int, device):
    """Yield ``(rows, PagedMeta, input_ids)`` prefill chunks of whole prompts (<= chunk_tokens
    tokens each, at least one prompt)."""
    n, plen = prompts.shape
    per = max(1, chunk_tokens // plen)
    for a in range(0, n, per):
        rows = np.arange(a, min(n, a + per))
        meta = PagedMeta.build(lane.block_tables_np[rows], np.zeros(len(rows)),
                               np.full(len(rows), plen), block_size, device, kvh)
        yield rows, meta, torch.from_numpy(prompts[rows].reshape(-1)).to(device)


class GreedyLoop:
    """Greedy generation with one :class:`PagedStage` holding every layer (PP=1).

    Args:
        model: the stage; graphs: captured decode graphs, or None (eager).
    """

    def __init__(self, model: PagedStage, graphs: DecodeGraphs | None) -> None:
        self.model, self.graphs = model, graphs
        self.bs, self.kvh = model.block_size, model.cfg.num_kv_heads
        self.pinned = [torch.empty(0, dtype=torch.int64).pin_memory() for _ in range(2)]

    def prefill(self, lane: LaneState, prompts: np.ndarray, chunk_tokens: int = 16384) -> None:
        """Prefill every prompt (``[n, prompt_len]`` ids); sets lane.ids / positions / seq_lens."""
        dev = lane.block_tables.device
        first = torch.empty(prompts.shape[0], dtype=torch.int64, device=dev)
        for rows, meta, ids in prefill_chunks(lane, prompts, chunk_tokens, self.bs, self.kvh, dev):
            logits = self.model.forward(meta, input_ids=ids)
            first[torch.from_numpy(rows).to(dev)] = logits.argmax(-1)
        plen = prompts.shape[1]
        lane.ids = first
        lane.positions = torch.full_like(lane.positions, plen)
        lane.seq_lens = torch.full_like(lane.seq_lens, plen + 1)

    def decode(self, lane: LaneState, steps: int, keep_tokens: bool = False,
               validate: str | None = None) -> dict:
        """Run ``steps`` decode steps; returns wall seconds and host seconds spent issuing.

        ``validate``: None (no per-slot state), or drive a real :class:`DeviceState` (post-update
        kernel + CPU mirror every step) with mirror validation ``"off"``, ``"sync"`` (the
        blocking ``DeviceState.validate``) or ``"async"`` (:class:`AsyncMirrorCheck`).
        """
        n = lane.positions.shape[0]
        state = check = None
        if validate is not None:
            state, check = _device_state(n, lane.positions.device, validate)
            slots_np, ones_np = np.arange(n), np.ones(n, dtype=np.int64)
            slots_t = torch.arange(n, device=state.device)
            ones_t = torch.ones(n, dtype=torch.int64, device=state.device)
        pinned = [torch.empty(n, dtype=torch.int64).pin_memory() for _ in range(2)]
        events = [torch.cuda.Event() for _ in range(2)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        issue = 0.0
        for s in range(steps):
            ti = time.perf_counter()
            meta = lane.meta(self.bs, self.kvh)
            if self.graphs is not None:
                logits = self.graphs.run(meta, input_ids=lane.ids)
            else:
                logits = self.model.forward(meta, input_ids=lane.ids)
            lane.ids = logits.argmax(-1)
            pinned[s % 2].copy_(lane.ids, non_blocking=True)
            events[s % 2].record()
            lane.advance()
            if state is not None:
                state.apply_scheduled(slots_t, ones_t, slots_np, ones_np)
                if validate == "sync":
                    state.validate(s)
                elif validate == "async":
                    check.snapshot(s)
            issue += time.perf_counter() - ti
            if s > 0:                                  # engine-facing wait, one step behind
                events[(s - 1) % 2].synchronize()
                if keep_tokens:
                    lane.tokens.append(pinned[(s - 1) % 2].clone())
        events[(steps - 1) % 2].synchronize()
        if keep_tokens:
            lane.tokens.append(pinned[(steps - 1) % 2].clone())
        if check is not None:
            check.poll(block=True)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "issue_s": issue, "steps": steps, "rows": n}


def _device_state(n: int, device, validate: str):
    """A DeviceState with ``n`` live requests (slots 0..n-1) and, for ``"async"``, its checker."""
    from ppstate.batch import NewRequest
    from runtime.worker.device_state import DeviceState
    from runtime.worker.mirror_check import AsyncMirrorCheck
    if validate not in ("off", "sync", "async"):
        raise ValueError(f"validate must be off, sync or async, got {validate!r}")
    state = DeviceState(n, 8, 1, device, rank=0, block_size=1 << 20)   # one block per request
    state.add_requests([NewRequest(f"r{i}", i, (1, 2, 3), 1 << 30) for i in range(n)])
    state.apply_block_updates(np.arange(n), np.zeros(n, dtype=np.int64), np.arange(n))
    return state, (AsyncMirrorCheck(state) if validate == "async" else None)
