"""``python -m runtime.bench contention``: one stage alone vs all stages at once, on this machine.

Overlapped PP beats sync only if a stage computing while the other stages compute runs about as
fast as a stage computing alone. Two processes on a machine with two cores (plus the engine
process) share those cores, caches and memory bandwidth; this measures what that costs, without
the engine, the scheduler or any transport in the way:

* one process per stage of the real model (the engine's layer split, fp32, the engine's batch-
  invariant GEMM padding), each timing its own forward over a decode step of ``rows`` rows (one
  new token per row, ``--context`` cached tokens each) and over prefill chunks of ``--chunk``
  tokens after ``--prefixes`` cached tokens (one row);
* **alone**: one stage times ``--iters`` forwards while the others sleep; **both**: every stage
  starts at one barrier and keeps computing until all have timed ``--iters`` forwards, so every
  timed forward ran while all stages computed;
* for each torch thread count (``--threads``) and each row count (``--rows``), medians over
  ``--repeats`` alternated rounds.

From these it reports, per thread count and concurrency ``B``, the ceiling the machine allows
for decode throughput overlapped / sync at PP=2 with ``B`` rows in two lanes (the scheduler's
split)::

    sync round       = sum over stages of alone(B)           (the stages take turns)
    overlapped round = pp_size x max over stages of both(B / pp_size)
    ceiling          = sync round / overlapped round          (pp_size when both == alone and
                                                               cost is linear in rows)

(engine, sampling and transport costs come on top of both rounds). It also fits the step-cost
model (:mod:`ppstate.step_cost`) to the alone times (mean stage; decode rows and the prefill
chunks, whose prefix term calibrates dynamic chunk sizing) with ``concurrency`` = median over
row counts of ``max stage both(r) / mean stage alone(r)``, and writes it under ``step_cost``
(``--step-cost FILE`` loads it into the engine: adaptive lanes and dynamic chunks).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from runtime.bench.results import subcommand_line, write_result

BLOCK = 16


def _stage_worker(conn, barrier, done, model: str, layer_range: tuple[int, int], max_rows: int,
                  context: int, max_prefill: int, seed: int) -> None:
    """Process of one stage: load it, then answer ``(rows, query_len, start, threads, iters,
    together)`` commands with the list of forward seconds (None ends the process)."""
    import torch

    from runtime.model.batch_meta import BatchMeta
    from runtime.model.stage import load_stage
    per_row = -(-(context + 2) // BLOCK)
    num_blocks = max(max_rows * per_row, -(-max_prefill // BLOCK))
    stage = load_stage(model, layer_range, max_num_reqs=max_rows, max_model_len=max_prefill + 2,
                       progress=False, num_blocks=num_blocks)
    width = -(-(max_prefill + 2) // BLOCK)
    # slot i owns blocks i * per_row ..; slot 0 also owns the run the longest prefill needs
    table = (torch.arange(max_rows)[:, None] * per_row + torch.arange(width)[None, :]) % num_blocks
    gen = torch.Generator().manual_seed(seed)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        rows, qlen, start, threads, iters, together = cmd
        torch.set_num_threads(threads)
        meta = BatchMeta.build(torch.arange(rows), torch.full((rows,), start),
                               torch.full((rows,), qlen), block_table=table, block_size=BLOCK)
        t = rows * qlen
        if stage.is_first:
            kw = {"input_ids": torch.randint(100, 40000, (t,), generator=gen)}
        else:
            h = stage.cfg.hidden_size
            kw = {"hidden": torch.randn(t, h, generator=gen), "residual": torch.randn(t, h, generator=gen)}
        stage(meta, **kw)   # warm-up
        times: list[float] = []
        if together:
            barrier.wait()
        while True:
            t0 = time.perf_counter()
            stage(meta, **kw)
            if len(times) < iters:
                times.append(time.perf_counter() - t0)
                if len(times) == iters and together:
                    with done.get_lock():
                        done.value += 1
            if not together and len(times) == iters:
                break
            if together and len(times) == iters and done.value >= barrier.parties:
                break
        if together:
            barrier.wait()
            with done.get_lock():
                done.value = 0
            barrier.wait()
        conn.send(times)
    conn.close()


class Stages:
    """One process per pipeline stage (context manager); :meth:`time` runs a step on some."""

    def __init__(self, model: str, pp_size: int, max_rows: int, context: int,
                 max_prefill: int) -> None:
        from runtime.model.partition import resolve_partition
        from runtime.model.stage import load_model_config
        self.ranges = resolve_partition(load_model_config(model), pp_size)
        ctx = mp.get_context("spawn")
        self.barrier, self.done = ctx.Barrier(pp_size), ctx.Value("i", 0)
        self.conns, self.procs = [], []
        for i, rng in enumerate(self.ranges):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_stage_worker, args=(b, self.barrier, self.done, model, rng,
                                                        max_rows, context, max_prefill, i),
                            daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("stage process failed to start")

    def time(self, stages: list[int], rows: int, qlen: int, start: int, threads: int,
             iters: int) -> list[float]:
        """Median forward seconds of each stage in ``stages`` (all of them: run at once)."""
        together = len(stages) == len(self.conns)
        for i in stages:
            self.conns[i].send((rows, qlen, start, threads, iters, together))
        return [statistics.median(self.conns[i].recv()) for i in stages]

    def __enter__(self) -> "Stages":
        return self

    def __exit__(self, *exc) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=30)


def measure(stages: Stages, rows_list: list[int], threads_list: list[int], context: int,
            chunk: int, prefixes: list[int], iters: int, repeats: int) -> dict:
    """Alone and both-at-once forward seconds per (threads, rows) and per prefill prefix; rounds
    alternate alone / both so a drift of a shared machine hits both alike."""
    pp = len(stages.conns)
    acc: dict[tuple, list[list[float]]] = {}
    shapes = [("decode", r, 1, context) for r in rows_list] + \
             [("prefill", 1, chunk, p) for p in prefixes]
    for rnd in range(repeats):
        for threads in threads_list:
            for kind, rows, qlen, start in shapes:
                key = (threads, kind, rows, start)
                alone = [stages.time([i], rows, qlen, start, threads, iters)[0] for i in range(pp)]
                both = stages.time(list(range(pp)), rows, qlen, start, threads, iters) \
                    if kind == "decode" else [float("nan")] * pp
                acc.setdefault(key, []).append(alone + both)
        print(f"  round {rnd + 1}/{repeats} done", flush=True)
    points = []
    for (threads, kind, rows, start), runs in acc.items():
        med = [statistics.median(col) for col in zip(*runs)]
        alone, both = med[:pp], med[pp:]
        pt = {"threads": threads, "kind": kind, "rows": rows,
              "query_len": 1 if kind == "decode" else chunk, "prefix": start,
              "alone_s": alone, "rounds": len(runs)}
        if kind == "decode":
            pt.update(both_s=both, slowdown=[b / a for a, b in zip(alone, both)])
        points.append(pt)
    return {"points": points}


def ceilings(points: list[dict], pp: int) -> list[dict]:
    """Per thread count and concurrency B (B / pp among the measured rows): the overlapped /
    sync ceiling with and without contention (formula in the module docstring)."""
    dec = {(p["threads"], p["rows"]): p for p in points if p["kind"] == "decode"}
    out = []
    for (threads, rows), p in sorted(dec.items()):
        half = dec.get((threads, rows // pp)) if rows % pp == 0 else None
        if half is None:
            continue
        sync_round = sum(p["alone_s"])
        over = pp * max(half["both_s"])
        ideal = pp * max(half["alone_s"])
        out.append({"threads": threads, "concurrency": rows, "sync_round_s": sync_round,
                    "overlapped_round_s": over, "ceiling": sync_round / over,
                    "ceiling_without_contention": sync_round / ideal})
    return out


def fit_step_cost(points: list[dict], threads: int, context: int) -> dict:
    """:class:`ppstate.step_cost.StepCostModel` fitted to the mean stage's alone seconds at
    ``threads`` torch threads (decode rows + prefill chunks), ``concurrency`` from both-at-once."""
    from ppstate.step_cost import fit
    samples, slow = [], []
    for p in points:
        if p["threads"] != threads:
            continue
        mean = statistics.mean(p["alone_s"])
        n, r = p["query_len"], p["rows"]
        pairs = r * context if p["kind"] == "decode" else n * (p["prefix"] + (n - 1) / 2.0)
        samples.append((r, r * n, pairs, mean))
        if p["kind"] == "decode":
            slow.append(max(p["both_s"]) / mean)
    conc = max(1.0, statistics.median(slow)) if slow else 1.0
    return fit(samples, concurrency=conc).to_dict() | {"num_samples": len(samples),
                                                        "threads": threads}


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        p.error(f"{flag} must be a comma list of integers, got {text!r}")
    if not vals or min(vals) < (0 if flag == "--prefixes" else 1):
        p.error(f"{flag} needs at least one value, each >= {0 if flag == '--prefixes' else 1}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.bench contention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--pp", type=int, default=2, help="stages (one process each)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="decode rows per step")
    p.add_argument("--threads", default="1,2", help="torch threads per stage process")
    p.add_argument("--context", type=int, default=32, help="cached tokens per decode row")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk tokens")
    p.add_argument("--prefixes", default="0,256,512,1024",
                   help="cached tokens before the prefill chunk (prefix-attention term)")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per point and stage")
    p.add_argument("--repeats", type=int, default=2, help="alternated rounds (medians)")
    p.add_argument("--fit-threads", type=int, default=1,
                   help="thread count whose times the step-cost fit uses (the engine's "
                        "--torch-threads)")
    p.add_argument("--json-out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    rows, threads = _ints(p, "--rows", args.rows), _ints(p, "--threads", args.threads)
    prefixes = _ints(p, "--prefixes", args.prefixes)
    if args.pp < 2 or args.iters < 1 or args.repeats < 1 or args.context < 1 or args.chunk < 1:
        p.error("--pp must be >= 2; --iters, --repeats, --context and --chunk >= 1")
    if args.fit_threads not in threads:
        p.error(f"--fit-threads {args.fit_threads} must be one of --threads {args.threads}")
    max_prefill = max(max(prefixes) + args.chunk, args.context + 2)
    with Stages(args.model, args.pp, max(rows), args.context, max_prefill) as stages:
        res = measure(stages, rows, threads, args.context, args.chunk, prefixes, args.iters,
                      args.repeats)
        res["layer_ranges"] = stages.ranges
    res["pp_size"] = args.pp
    res["ceilings"] = ceilings(res["points"], args.pp)
    res["step_cost"] = fit_step_cost(res["points"], args.fit_threads, args.context)
    for pt in res["points"]:
        if pt["kind"] == "decode":
            print(f"threads {pt['threads']} rows {pt['rows']:3d}: alone "
                  + " ".join(f"{1e3 * s:7.1f}" for s in pt["alone_s"]) + " ms, both "
                  + " ".join(f"{1e3 * s:7.1f}" for s in pt["both_s"]) + " ms", flush=True)
        else:
            print(f"threads {pt['threads']} chunk {pt['query_len']} after {pt['prefix']:5d}: "
                  + " ".join(f"{1e3 * s:7.1f}" for s in pt["alone_s"]) + " ms", flush=True)
    for c in res["ceilings"]:
        print(f"threads {c['threads']} concurrency {c['concurrency']:3d}: overlapped / sync "
              f"ceiling {c['ceiling']:.2f} (without contention {c['ceiling_without_contention']:.2f})")
    print(f"step_cost {res['step_cost']}", flush=True)
    if args.json_out:
        write_result(args.json_out, "contention", res, vars(args),
                     subcommand_line("contention", argv))
        print(f"wrote {args.json_out}")
    return 0
