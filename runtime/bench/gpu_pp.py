"""PP=2 over NCCL on two GPUs: overlapped (two lanes in flight) vs sync (one batch in flight),
on the GPU fast path, with the runtime's process groups (:mod:`runtime.worker.groups`).

Each rank is a process owning one GPU and half the layers (random benchmark weights, so both
ranks agree with the PP=1 model). Per decode step of a lane: rank 0 runs its captured graph and
sends ``(hidden, residual)`` to rank 1 by p2p; rank 1 runs its graph, takes the argmax and
broadcasts the ids on the sibling group from a side stream; rank 0 feeds them to that lane's next
step (stream-ordered wait: rank 0's host never blocks). Sync mode keeps one lane of all rows, so
the ranks alternate (the bubble); overlapped mode splits the rows into two lanes, so rank 0
computes one lane while rank 1 computes the other (bubble-free PP, docs/design.md §1).

Long-prompt workload: ``n`` prompts prefilled one per step; sync waits for each prompt's first
token before sending the next, overlapped streams them; TTFT of each prompt is read on rank 1
with CUDA events from a common start (after a barrier).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
import torch.distributed as dist

from runtime.bench.gpu_decode import make_lane, prefill_chunks
from runtime.bench.gpu_models import model_config, random_stage
from runtime.model.paged_stage import PagedMeta, PagedStage
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.groups import destroy_groups, init_groups

BLOCK = 16


def _prefill_lane(g, model, lane, prompts, kvh, hsz):
    """Prefill a lane through both stages; afterwards rank 0 holds the pending first-token
    broadcast ``(work, buf)`` and rank 1 the first ids in ``lane.ids``."""
    dev = lane.block_tables.device
    n, plen = prompts.shape
    first = torch.empty(n, dtype=torch.int64, device=dev)
    for rows, meta, ids in prefill_chunks(lane, prompts, 16384, BLOCK, kvh, dev):
        if g.is_first:
            g.send_next(torch.stack(model.forward(meta, input_ids=ids)))
        else:
            packed = g.recv_prev((2, ids.shape[0], hsz), model.kv_cache.dtype)
            first[torch.from_numpy(rows).to(dev)] = model.forward(meta, hidden=packed[0],
                                                                  residual=packed[1]).argmax(-1)
    lane.positions = torch.full_like(lane.positions, plen)
    lane.seq_lens = torch.full_like(lane.seq_lens, plen + 1)
    if g.is_first:
        return g.post_broadcast(first)
    lane.ids = first
    work, buf = g.post_broadcast(first)
    g.keep_pending(work, buf)
    return None


def decode_job(g, model, graphs, mode: str, batch: int, plen: int, new: int, vocab: int,
               keep_tokens: bool = False) -> dict:
    """Decode-heavy workload; returns wall seconds and tokens/s (measured on rank 1) and, with
    ``keep_tokens``, rank 1's greedy ids ``[batch][new]`` (rows of lane 0 first)."""
    dev, kvh, hsz = model.kv_cache.device, model.cfg.num_kv_heads, model.cfg.hidden_size
    lanes_n = 2 if mode == "overlapped" else 1
    per = batch // lanes_n
    bpr = -(-(plen + new) // BLOCK)
    lanes = [make_lane(per, bpr, i * per * bpr, dev, seed=i) for i in range(lanes_n)]
    rng = np.random.default_rng(1)
    prompts = np.split(rng.integers(100, vocab - 1, (batch, plen)), lanes_n)
    kept: list[list[torch.Tensor]] = [[] for _ in lanes]
    torch.cuda.synchronize()
    dist.barrier(group=g.pp_group)
    t0 = time.perf_counter()
    pending = [_prefill_lane(g, model, lane, p, kvh, hsz) for lane, p in zip(lanes, prompts)]
    if keep_tokens and not g.is_first:
        kept = [[lane.ids.cpu()] for lane in lanes]
    events = [torch.cuda.Event() for _ in range(4)]
    for s in range(new - 1):
        for i, lane in enumerate(lanes):
            meta = lane.meta(BLOCK, kvh)
            if g.is_first:
                work, buf = pending[i]
                work.wait()                        # stream-ordered: the host goes on
                out = graphs.run(meta, input_ids=buf)
                g.send_next(torch.stack(out))
                pending[i] = g.post_broadcast(torch.empty(per, dtype=torch.int64, device=dev))
            else:
                packed = g.recv_prev((2, per, hsz), model.kv_cache.dtype)
                lane.ids = graphs.run(meta, hidden=packed[0], residual=packed[1]).argmax(-1)
                work, buf = g.post_broadcast(lane.ids)
                g.keep_pending(work, buf)
                if keep_tokens:
                    kept[i].append(lane.ids.cpu())     # test mode only: a host sync per step
                ev = events[(s * lanes_n + i) % 4]
                ev.record()
                if s > 1:   # engine-facing host wait, two lane-steps behind
                    events[(s * lanes_n + i - 2) % 4].synchronize()
            lane.advance()
    if g.is_first:
        for work, _ in pending:
            work.wait()
    torch.cuda.synchronize()
    g.drain()
    wall = time.perf_counter() - t0
    res = {"mode": mode, "batch": batch, "wall_s": wall, "tokens_per_s": batch * new / wall}
    if keep_tokens and not g.is_first:
        res["tokens"] = torch.cat([torch.stack(k, 1) for k in kept], 0).tolist()
    return res


def prompt_chunks(lane, prompts: np.ndarray, chunk: int, block_size: int, kvh: int, device):
    """Yield ``(prompt_index, is_final, PagedMeta, input_ids)`` for every chunk of every prompt,
    prompt by prompt: chunk ``k`` of a prompt covers its tokens ``[k * chunk, (k + 1) * chunk)``
    and attends to the ``k * chunk`` tokens its earlier chunks cached (chunked prefill)."""
    n, plen = prompts.shape
    for i in range(n):
        for start in range(0, plen, chunk):
            qlen = min(chunk, plen - start)
            meta = PagedMeta.build(lane.block_tables_np[[i]], np.array([start]), np.array([qlen]),
                                   block_size, device, kvh)
            ids = torch.from_numpy(prompts[i, start:start + qlen].copy()).to(device)
            yield i, start + qlen == plen, meta, ids


def ttft_job(g, model, mode: str, n: int, plen: int, vocab: int, chunk: int | None = None) -> dict:
    """Long-prompt workload: mean TTFT (seconds) of ``n`` prompts of ``plen`` tokens, prefilled
    prompt by prompt in chunks of ``chunk`` tokens (default: the whole prompt in one step).

    Sync (one step in flight): rank 0 sends the next chunk only after rank 1 finished the
    previous one (a one-element done signal per step on the broadcast group; the first token
    for a final chunk). Overlapped: chunks stream through both ranks back to back; only final
    chunks broadcast (a step of non-final chunk rows samples nothing anyone needs).
    """
    dev, kvh, hsz = model.kv_cache.device, model.cfg.num_kv_heads, model.cfg.hidden_size
    lane = make_lane(n, -(-(plen + 1) // BLOCK), 0, dev, seed=3)
    prompts = np.random.default_rng(2).integers(100, vocab - 1, (n, plen))
    chunks = list(prompt_chunks(lane, prompts, chunk or plen, BLOCK, kvh, dev))
    start = torch.cuda.Event(enable_timing=True)
    done = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    torch.cuda.synchronize()
    dist.barrier(group=g.pp_group)
    start.record()
    works = []
    for c, final, meta, ids in chunks:
        signal = final or mode == "sync"
        if g.is_first:
            g.send_next(torch.stack(model.forward(meta, input_ids=ids)))
            if signal:
                work, buf = g.post_broadcast(torch.empty(1, dtype=torch.int64, device=dev))
                if mode == "sync":
                    work.wait()                    # next step only after this one finished
                works.append(work)
        else:
            packed = g.recv_prev((2, ids.shape[0], hsz), model.kv_cache.dtype)
            logits = model.forward(meta, hidden=packed[0], residual=packed[1])
            if final:
                done[c].record()
            if signal:
                work, buf = g.post_broadcast(logits.argmax(-1))
                g.keep_pending(work, buf)
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    g.drain()
    if g.is_first:
        return {"mode": mode}
    ttft = [start.elapsed_time(e) / 1e3 for e in done]
    return {"mode": mode, "chunk": chunk or plen, "ttft_s": ttft,
            "mean_ttft_s": float(np.mean(ttft))}


def order_job(g, steps: int) -> dict:
    """Side-stream broadcast order: rank 1 broadcasts ``[s, s+1, ...]`` at step s, with compute
    queued on its main stream in between; rank 0 checks every buffer after its stream-ordered
    wait. Returns the number of steps whose buffer was wrong (0 expected)."""
    dev = g.device
    got, x = [], torch.randn(512, 512, device=dev)
    for s in range(steps):
        x = (x @ x).tanh()                            # keep the compute stream busy
        if g.is_first:
            work, buf = g.post_broadcast(torch.full((64,), -1, dtype=torch.int64, device=dev))
            work.wait()
            got.append((buf - torch.arange(64, device=dev)).ne(s).any())
        else:
            t = torch.arange(64, device=dev) + s
            work, buf = g.post_broadcast(t)
            g.keep_pending(work, buf)
    torch.cuda.synchronize()
    g.drain()
    return {"wrong_steps": int(torch.stack(got).sum()) if got else 0}


def pp_worker(rank: int, shape: str, port: int, jobs: list[dict], queue) -> None:
    """Process body of one PP rank: build the half model, capture graphs, run ``jobs``."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    g = init_groups(rank, 2, f"tcp://127.0.0.1:{port}", dev, 900)
    try:
        cfg = model_config(shape)
        half = cfg.num_layers // 2
        stage = random_stage(shape, (0, half) if rank == 0 else (half, cfg.num_layers), dev)
        max_len = max(j.get("plen", 0) + j.get("new", 0) for j in jobs) + BLOCK + 1
        num_blocks = max(j.get("batch", j.get("n", 1)) * (-(-max_len // BLOCK)) for j in jobs) + 8
        model = PagedStage(stage, num_blocks, max_len)
        graphs = DecodeGraphs(model, max(j.get("batch", 1) for j in jobs), -(-max_len // BLOCK),
                              max_len)
        rep = graphs.capture(progress=False)
        out = []
        for j in jobs:
            if j["kind"] == "decode":
                out.append(decode_job(g, model, graphs, j["mode"], j["batch"], j["plen"], j["new"],
                                      cfg.vocab_size, j.get("keep_tokens", False)))
            elif j["kind"] == "order":
                out.append(order_job(g, j["steps"]))
            else:
                out.append(ttft_job(g, model, j["mode"], j["n"], j["plen"], cfg.vocab_size,
                                    j.get("chunk")))
        queue.put((rank, {"results": out, "capture_s": rep.seconds, "capture_bytes": rep.bytes,
                          "pid": os.getpid()}))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        queue.put((rank, {"error": repr(exc)}))
        raise
    finally:
        destroy_groups(g)


def run_pp2(shape: str, jobs: list[dict], port: int = 29611) -> dict[int, dict]:
    """Spawn two ranks (GPU 0 and 1) and return ``{rank: {"results": [...], ...}}``.

    Raises:
        RuntimeError: a rank failed (its exception's repr).
    """
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=pp_worker, args=(r, shape, port, jobs, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in (0, 1):
        if "error" in got[r]:
            raise RuntimeError(f"PP rank {r}: {got[r]['error']}")
    return got
