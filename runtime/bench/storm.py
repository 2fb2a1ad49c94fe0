"""``python -m runtime.bench.storm``: an abort storm against a real engine (issue #12, item 2).

``--streams`` concurrent greedy streams (EOS ignored, ``--max-tokens`` each); ``--disconnect`` of
them leave at a random point, as a client that drops its connection does (the server then closes
the stream and aborts the request): before the first token, mid-decode (after a random number of
tokens), or during chunked prefill (every third leaver has a prompt longer than
``--max-prefill-chunk`` and leaves while its request is ``prefilling``). Then one more request is
served. Checks, all exact:

* every staying stream got exactly ``max_tokens`` tokens, finish reason ``length``;
* every leaving stream got fewer, and its request ended ``finished_aborted`` (or finished normally
  when it had all its tokens before the disconnect landed);
* after the storm every slot is free, nothing waits or runs;
* each slot's generation counter on the non-last ranks (``pp.free`` events of the rank trace)
  advanced exactly once per FreedSlot the scheduler delivered for it (``schedule`` events);
* the request after the storm returns the same tokens as the first staying stream of its prompt.

Prints one JSON line of counts; exit status 1 when a check fails. The storm runs with
``--trace-dir`` (a temporary directory unless given) so the generation counters can be read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

from ppstate.codec import decode_output
from ppstate.trace.run import ENGINE_FILE
from runtime.cli_common import add_engine_flags, engine_config
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams


async def _client(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams,
                  leave: str | None, leave_after: int) -> dict:
    """One client: read the stream; ``leave`` in (None, "before_first", "mid_decode", "prefill")."""
    gen = engine.add_request(rid, ids, params)
    tokens, reason, phase, nxt = [], None, None, None
    try:
        while True:
            state = _state(engine, rid)
            if leave == "before_first" or (leave == "prefill" and state == "prefilling"):
                phase = state
                break
            nxt = nxt or asyncio.ensure_future(anext(gen))
            done, _ = await asyncio.wait({nxt}, timeout=0.001 if leave == "prefill" else None)
            if not done:
                continue  # still waiting or prefilling: look at the state again
            out, nxt = nxt.result(), None
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
            if out.finished:
                break
            if leave == "mid_decode" and len(tokens) >= leave_after:
                phase = _state(engine, rid)
                break
    finally:
        if nxt is not None:          # a pending read is dropped with the connection
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
        if reason is None:           # what the server does when the client goes away
            await gen.aclose()
            await engine.abort(rid)
    return {"rid": rid, "leave": leave, "phase": phase, "tokens": tokens, "reason": reason}


def _state(engine: AsyncEngine, rid: str) -> str | None:
    try:
        return engine.sched.state_of(rid)
    except Exception:  # noqa: BLE001 - forgotten after finishing long ago
        return None


def generation_check(run_dir: Path) -> dict:
    """Per slot: FreedSlots the scheduler delivered vs. the final generation on each non-last
    rank (from the ``pp.free`` events). Returns counts and the mismatching slots."""
    freed: Counter = Counter()
    for line in (run_dir / ENGINE_FILE).open():
        ev = json.loads(line)
        if ev["kind"] == "schedule":
            freed.update(f.slot for f in decode_output(ev["output"]).freed)
    ranks, jumps = {}, []
    for path in sorted(run_dir.glob("rank*.jsonl")):
        gen: dict[int, int] = {}
        for line in path.open():
            ev = json.loads(line)
            if ev["kind"] == "pp.free":
                if ev["generation"] != gen.get(ev["slot"], 0) + 1:  # not one step per free
                    jumps.append((path.stem, ev["slot"], ev["generation"]))
                gen[ev["slot"]] = ev["generation"]
        if gen:
            ranks[path.stem] = gen
    bad = {r: sorted(s for s in set(freed) | set(g) if freed[s] != g.get(s, 0))
           for r, g in ranks.items()}
    for rank, slot, _ in jumps:
        bad.setdefault(rank, []).append(slot)
    return {"freed_total": sum(freed.values()), "ranks_checked": sorted(ranks),
            "mismatched_slots": {r: b for r, b in bad.items() if b}}


async def storm(engine: AsyncEngine, n_streams: int, n_leave: int, max_tokens: int,
                seed: int) -> dict:
    """Run the storm on a started engine; returns the counts and a list of failed checks."""
    rng = random.Random(seed)
    chunk = engine.config.scheduler.max_prefill_chunk
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    kinds = ["before_first", "mid_decode", "prefill"]  # a third of the leavers each
    leave_of = {i: kinds[j % 3] for j, i in enumerate(sorted(rng.sample(range(n_streams), n_leave)))}
    jobs = []
    for i in range(n_streams):
        leave = leave_of.get(i)
        plen = rng.randrange(chunk + 1, 2 * chunk + 1) if leave == "prefill" else rng.randrange(3, 12)
        ids = [rng.randrange(100, 40000) for _ in range(plen)]
        jobs.append((f"s{i}", ids, leave, rng.randrange(1, max_tokens)))
    results = await asyncio.gather(*(_client(engine, rid, ids, params, leave, k)
                                     for rid, ids, leave, k in jobs))
    failed = []
    for (rid, ids, leave, _), r in zip(jobs, results):
        if leave is None and (len(r["tokens"]) != max_tokens or r["reason"] != "length"):
            failed.append(f"{rid}: stayed but got {len(r['tokens'])} tokens, {r['reason']}")
        if leave is not None and r["reason"] is None and len(r["tokens"]) >= max_tokens:
            failed.append(f"{rid}: left but got {len(r['tokens'])} tokens")
    stay = next((j, r) for j, r in zip(jobs, results) if j[2] is None)
    after = await _client(engine, "after-storm", stay[0][1], params, None, 0)
    if after["tokens"] != stay[1]["tokens"]:
        failed.append("the request after the storm differs from the same prompt during it")
    s = engine.sched
    if (s.slots.num_free, s.num_running, s.num_waiting) != (s.config.max_num_seqs, 0, 0):
        failed.append(f"not all slots free: free={s.slots.num_free} running={s.num_running} "
                      f"waiting={s.num_waiting}")
    phases = Counter(f"{r['leave']}@{r['phase'] if r['reason'] is None else 'finished'}"
                     for r in results if r["leave"])
    return {"streams": n_streams, "left": n_leave, "completed": sum(r["reason"] == "length" for r in results),
            "aborted": sum(r["reason"] is None for r in results), "leave_phases": dict(phases),
            "slots_free": s.slots.num_free, "failed": failed}


async def run(config, n_streams: int, n_leave: int, max_tokens: int, seed: int) -> dict:
    """Start an engine (tracing into ``config.trace_dir``), storm it, check the generations."""
    engine = await AsyncEngine.start(config)
    try:
        report = await storm(engine, n_streams, n_leave, max_tokens, seed)
        run_dir = Path(engine.config.trace_dir)
    finally:
        await engine.shutdown()
    gens = generation_check(run_dir)
    if gens["mismatched_slots"]:
        report["failed"].append(f"generation counters differ from frees: {gens['mismatched_slots']}")
    return {**report, "generations": gens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.bench.storm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--disconnect", type=int, default=150, help="streams that leave early")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    add_engine_flags(p)
    args = p.parse_args(argv)
    if not 0 <= args.disconnect <= args.streams - 1:
        p.error(f"--disconnect: must be in 0..{args.streams - 1} (one stream must stay)")
    config = engine_config(p, args)
    with tempfile.TemporaryDirectory(prefix="ppstate-storm-") as tmp:
        config = config.model_copy(update={"trace_dir": config.trace_dir or tmp})
        report = asyncio.run(run(config, args.streams, args.disconnect, args.max_tokens, args.seed))
    print(json.dumps(report), flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
