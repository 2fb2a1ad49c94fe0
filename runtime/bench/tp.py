"""``python -m runtime.bench.tp``: greedy generation through the real engine at several
``(tp, pp)`` layouts of one model, the ids compared with the first layout's and the decode rate
of each (docs/tp.md).

Example (the one-GPU run of benchmarks/device/tp.sh: TP ranks share the GPU over gloo staging)::

    python -m runtime.bench.tp --model FOLDER --device cuda --layouts 1x1,2x1,2x2 \\
        --json-out benchmarks/results/tp.json

A layout is ``TPxPP`` (the CUDA fast path: Triton kernels, decode CUDA graphs, piecewise under TP
over gloo) or ``TPxPP:ref`` (``--cuda-path reference``). Per layout: ``seconds`` (wall time of the whole batch, prefill included),
``tokens_per_s`` (output tokens / seconds), ``agree`` (ids equal to the first layout's, per
prompt, up to the first difference), ``first_diff`` (index of the first differing id, or None) and
``cuda_graphs`` (rank 0's capture report: buckets, seconds, bytes, graphs per step).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import time

from runtime.bench.results import write_result


def parse_layout(text: str) -> tuple[int, int, str | None]:
    """``"2x2"`` -> ``(tp, pp, None)``; ``"2x2:ref"`` -> ``(2, 2, "reference")`` (the CUDA
    reference path, ``--cuda-path reference``). Raises ValueError on another form."""
    shape, _, path = text.partition(":")
    tp, _, pp = shape.partition("x")
    if not tp.isdigit() or not pp.isdigit() or path not in ("", "ref"):
        raise ValueError(f"--layouts: {text!r} is not TPxPP or TPxPP:ref (e.g. 2x2, 2x2:ref)")
    return int(tp), int(pp), ("reference" if path else None)


async def run_layout(base: dict, tp: int, pp: int, prompts: list[list[int]],
                     new_tokens: int, info: dict | None = None) -> tuple[list[list[int]], float]:
    """Greedy ids of every prompt (all in flight at once) and the wall seconds they took;
    ``info``, if given, receives every rank's ready report (``{rank: {"cuda_graphs": ...}}``)."""
    from runtime.config import EngineConfig
    from runtime.engine import AsyncEngine
    from runtime.sampling_params import SamplingParams
    engine = await AsyncEngine.start(EngineConfig(**base, tp_size=tp, pp_size=pp))
    if info is not None:
        info.update(engine.pool.ready_info)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    try:
        async def one(i: int, p: list[int]) -> list[int]:
            ids: list[int] = []
            async for out in engine.add_request(f"tp{i}", p, params):
                if out.error:
                    raise RuntimeError(out.error)
                ids += out.new_token_ids
            return ids
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return got, time.perf_counter() - t0
    finally:
        await engine.shutdown()


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing id of ``a`` and ``b`` (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> dict:
    """Run every layout of ``--layouts`` in turn; returns the per-layout results (module doc),
    also written to ``--json-out``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layouts", default="1x1,2x1,2x2", help="TPxPP, comma-separated")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--vocab-max", type=int, default=1000, help="prompt ids drawn from [10, N)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, args.vocab_max) for _ in range(args.prompt_len)]
               for _ in range(args.prompts)]
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(8, args.prompts),
                max_model_len=args.prompt_len + args.new_tokens + 16, mode="overlapped",
                enforce_eager=args.enforce_eager)
    results, ref = {}, None
    for text in args.layouts.split(","):
        tp, pp, path = parse_layout(text)
        info: dict = {}
        ids, secs = asyncio.run(run_layout(dict(base, **({"cuda_path": path} if path else {})),
                                           tp, pp, prompts, args.new_tokens, info))
        ref = ids if ref is None else ref
        diffs = [first_diff(a, b) for a, b in zip(ids, ref)]
        results[text] = {"tp": tp, "pp": pp, "seconds": round(secs, 3),
                         "tokens_per_s": round(sum(map(len, ids)) / secs, 1),
                         "agree": sum(d is None for d in diffs), "first_diff": diffs,
                         "cuda_graphs": info.get(0, {}).get("cuda_graphs"), "ids": ids}
        print(f"{text}: {secs:.2f} s, {results[text]['tokens_per_s']} tok/s, "
              f"{results[text]['agree']}/{len(ids)} prompts equal to {args.layouts.split(',')[0]}",
              flush=True)
    if args.json_out:
        write_result(args.json_out, "tp", results, vars(args),
                     "python -m runtime.bench.tp " + shlex.join(sys.argv[1:] if argv is None else argv))
    return results


if __name__ == "__main__":
    main()
