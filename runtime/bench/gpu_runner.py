"""``python -m runtime.bench.gpu_runner``: one PP=1 rank's step loop on the GPU, without the engine.

The real :class:`~ppstate.scheduler.Scheduler` (overlapped, two steps in flight) feeds the real
:class:`~runtime.worker.runner.StageRunner` (fast path, CUDA graphs, device state, sampler, mirror
validation) in one process, the way the worker serves the engine: step N+1 is launched before step
N's sampled ids are read. No messages, no tokenizer, no HTTP: what is left is the rank's own host
work, which is what this measures.

Per decode step with ``--rows`` rows (random bf16 weights of ``--shape``, greedy, EOS ignored):

* ``launch_ms``: host time inside ``StageRunner.launch`` (input preparation, metadata, graph
  replay, sampling, post-update, async copy of the sampled ids; everything the rank does outside
  the GPU's kernels except waiting for them);
* ``wait_ms``: host time blocked on the step's event (the GPU still busy);
* ``sched_ms``: the scheduler's ``schedule`` + ``on_step_result``;
* ``step_ms``: wall time per step in steady state, and output tokens/s.

A runner without ``launch`` (the code before #13's host-copy work) is driven through ``step``,
which waits for the GPU inside; its ``launch_ms`` then includes the wait.
Prints one JSON object per ``--validate-every`` value; ``--out`` writes them all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import numpy as np
import torch

from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from ppstate.step_updates import count_tokens
from runtime.bench.gpu_models import model_config, random_tensor
from runtime.model.paged_stage import PagedStage
from runtime.model.stage import StageModel
from runtime.model.tensor_names import stage_tensor_names
from runtime.worker.cuda_graphs import DecodeGraphs
from runtime.worker.device_state import DeviceState
from runtime.worker.groups import PPGroups
from runtime.worker.runner import StageRunner

BLOCK = 16


def build_runner(shape: str, rows: int, max_model_len: int, validate_every: int, dev, graphs=True):
    """A PP=1 StageRunner over random weights, its KV cache sized for ``rows`` full contexts."""
    cfg = model_config(shape)
    names = stage_tensor_names(cfg, (0, cfg.num_layers))
    weights = {n: random_tensor(cfg, n, dev, torch.bfloat16) for n in names}
    mb = -(-max_model_len // BLOCK)
    stage = StageModel(cfg, (0, cfg.num_layers), weights, max_num_reqs=rows, max_model_len=max_model_len,
                       dtype=torch.bfloat16, device=dev, block_size=BLOCK, num_blocks=rows * mb + 8).eval()
    fast = PagedStage(stage)
    g = None
    if graphs:
        g = DecodeGraphs(fast, rows, mb, max_model_len)
        g.capture(progress=False)
    state = DeviceState(rows, max_model_len, 1, dev, 0, BLOCK)
    groups = PPGroups(rank=0, pp_size=1, backend="gloo", device=dev, timeout=timedelta(seconds=60))
    runner = StageRunner(groups, stage, state, True, validate_every, fast=fast, graphs=g)
    return runner, cfg, rows * mb + 8


def run(runner, vocab: int, num_blocks: int, rows: int, prompt_len: int, new_tokens: int,
        max_model_len: int, seed: int = 0) -> dict:
    """Serve ``rows`` requests to completion; per-step figures of the full-width decode steps."""
    sched = Scheduler(SchedulerConfig(
        pp_size=1, max_num_seqs=rows, max_num_batched_tokens=max(4096, rows * prompt_len),
        max_prefill_chunk=4096, max_model_len=max_model_len, mode="overlapped",
        block_size=BLOCK, num_kv_blocks=num_blocks, enable_prefix_caching=False))
    rng = np.random.default_rng(seed)
    sampling = {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True}
    for i in range(rows):
        sched.add_request(RequestSpec(req_id=f"r{i}", prompt_token_ids=tuple(
            rng.integers(100, vocab - 1, prompt_len).tolist()), max_tokens=new_tokens,
            ignore_eos=True, sampling=sampling))
    launch = getattr(runner, "launch", None)
    order = getattr(runner, "_order", None)
    if order is not None:   # each run's fresh Scheduler numbers its steps from 0 again
        order.next_step = 0
    held, tokens, per_step = None, 0, []
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    t_start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        if out is None and held is None:
            break
        pending, t2 = None, t1
        if out is not None:
            pending = launch(out) if launch is not None else runner.step(out)
            t2 = time.perf_counter()
        wait = 0.0
        if held is not None:
            res = held.result() if launch is not None else held
            t3 = time.perf_counter()
            wait = t3 - t2
            upd = sched.on_step_result(res)
            tokens += count_tokens(upd)
            t4 = time.perf_counter()
        else:
            t4 = t3 = t2
        held = pending
        if out is not None and out.num_rows == rows and int(out.num_scheduled_tokens.max()) == 1:
            per_step.append((t2 - t1, wait, (t1 - t0) + (t4 - t3), t4))
    wall = time.perf_counter() - t_start
    steady = per_step[2:-2] if len(per_step) > 8 else per_step
    ends = [s[3] for s in steady]
    ms = lambda xs: 1e3 * statistics.median(xs) if xs else None  # noqa: E731
    return {"rows": rows, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "decode_steps": len(per_step), "launch_ms": ms([s[0] for s in steady]),
            "launch_ms_mean": 1e3 * statistics.mean(s[0] for s in steady) if steady else None,
            "wait_ms": ms([s[1] for s in steady]), "sched_ms": ms([s[2] for s in steady]),
            "step_ms": 1e3 * (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else None,
            "runner_api": "launch" if launch is not None else "step"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.gpu_runner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--validate-every", default="1,0", help="comma list: mirror validation every N "
                   "steps (0 = off)")
    p.add_argument("--repeat", type=int, default=2, help="runs per setting (the best is kept)")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--profile", default=None, metavar="FILE", help="also run once under cProfile "
                   "and write the functions with the most own time to FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("python -m runtime.bench.gpu_runner needs a CUDA device")
    dev = torch.device("cuda", 0)
    max_len = -(-(args.prompt_len + args.new_tokens + 1) // BLOCK) * BLOCK
    results = []
    runner, cfg, nb = build_runner(args.shape, args.rows, max_len, 1, dev)
    run(runner, cfg.vocab_size, nb, args.rows, args.prompt_len, 8, max_len)   # warm-up
    for v in (int(x) for x in args.validate_every.split(",")):
        runner.mirrors.every = v
        runs = [run(runner, cfg.vocab_size, nb, args.rows, args.prompt_len, args.new_tokens, max_len)
                for _ in range(args.repeat)]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        best.update(shape=args.shape, validate_every=v,
                    all_tokens_per_s=[r["tokens_per_s"] for r in runs])
        print(json.dumps(best), flush=True)
        results.append(best)
    if args.profile:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        run(runner, cfg.vocab_size, nb, args.rows, args.prompt_len, args.new_tokens, max_len)
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumtime").print_stats(60)
        with open(args.profile, "w") as f:
            f.write(buf.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "command": "python -m runtime.bench."
                       "gpu_runner " + " ".join(sys.argv[1:] if argv is None else argv),
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
