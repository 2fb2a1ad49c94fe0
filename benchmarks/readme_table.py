"""Generate the README's benchmark tables from ``benchmarks/results/*.json`` (kinds ``pp``,
``sched``, ``contention`` and ``cpu_serve``, written by ``python -m runtime.bench
pp|sched|contention|cpu-serve --json-out``; of ``cpu_serve`` the newest file that ran llama.cpp
(any, when none did) as the serving table, and each newer one as a line of its own: an A/B run of
a few ppstate servers, e.g. ``--only fast-pp1,fast-pp2 --rounds 4``).

``python benchmarks/readme_table.py`` rewrites the block between the two marker comments in
README.md; ``--check`` exits 1 when the block differs from what the results say
(tests/runtime/test_bench_readme.py runs the check). A metric found in several files is taken from the
newest (by the file's ``date``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"

#: (results key, label, target, format) of the headline table, in order
METRICS = [
    ("throughput_ratio", "decode throughput overlapped / sync (PP=2)", ">= 1.8", "{:.2f}"),
    ("efficiency", "PP efficiency = ratio / pp_size", ">= 0.9", "{:.2f}"),
    ("ttft_ratio", "long-prompt TTFT sync / overlapped", ">= 1.6", "{:.2f}"),
    ("dynamic_chunk_ttft_ratio", "long-prompt TTFT fixed / dynamic chunks", "> 1", "{:.2f}"),
    ("trace_overhead", "tracing: throughput lost", "<= 5%", "{:.1%}"),
    ("mirror_validation_overhead", "mirror validation: throughput lost", "<= 2%", "{:.1%}"),
]
SPREAD = {"throughput_ratio": ("decode", "throughput_ratio_spread"),
          "ttft_ratio": ("prefill", "ttft_ratio_spread"),
          "dynamic_chunk_ttft_ratio": ("prefill", "dynamic_chunk_ttft_ratio_spread"),
          "trace_overhead": ("overheads", "trace", "on_over_off"),
          "mirror_validation_overhead": ("overheads", "mirror_validation", "on_over_off")}


def load_results(folder: Path = RESULTS) -> list[tuple[str, dict]]:
    """``(file name, document)`` of every pp / sched result, oldest first."""
    docs = []
    for f in sorted(folder.glob("*.json")):
        doc = json.loads(f.read_text())
        if isinstance(doc, dict) and doc.get("kind") in ("pp", "sched", "contention", "cpu_serve"):
            docs.append((f.name, doc))
    return sorted(docs, key=lambda d: (d[1]["date"], d[0]))


#: where a headline metric may sit besides the top level of ``results`` (older result files)
NESTED = {"dynamic_chunk_ttft_ratio": ("prefill",), "ttft_ratio": ("prefill",),
          "throughput_ratio": ("decode",), "efficiency": ("decode",)}


def metric(res: dict, key: str):
    """``res[key]``, or the same key inside its workload's section; None when absent."""
    if res.get(key) is not None:
        return res[key]
    return _dig(res, NESTED.get(key, ("-",)) + (key,))


def _dig(doc: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def _spread(key: str, res: dict) -> str:
    s = _dig(res, SPREAD.get(key, ("-",)))
    if not s:
        return ""
    if key.endswith("overhead"):   # spread of on/off ratios -> lost throughput range
        return f"{1 - s['max']:.1%} .. {1 - s['min']:.1%}"
    return f"{s['min']:.2f} .. {s['max']:.2f}"


def render(docs: list[tuple[str, dict]]) -> str:
    """The markdown between the markers (tables + the commands that produced them)."""
    found: dict[str, tuple[str, dict]] = {}
    sweep, sched = None, None
    contention: list[tuple[str, dict]] = []   # every machine's contention file, one table each
    serving, ab = None, []
    for name, doc in docs:                 # newer files override older ones
        res = doc["results"]
        if doc["kind"] == "cpu_serve":
            if serving is None or "llama.cpp" in res["servers"] \
                    or "llama.cpp" not in serving[1]["results"]["servers"]:
                serving, ab = (name, doc), []
            else:
                ab.append((name, doc))
            continue
        for key, *_ in METRICS:
            if metric(res, key) is not None:
                found[key] = (name, doc)
        if doc["kind"] == "pp" and res.get("sweep"):
            sweep = (name, doc)
        if doc["kind"] == "sched":
            sched = (name, doc)
        if doc["kind"] == "contention":
            contention = [c for c in contention if c[1]["machine"] != doc["machine"]] + [(name, doc)]
    lines = ["| metric | median | spread (min .. max over rounds) | target | result file |",
             "|---|---|---|---|---|"]
    for key, label, target, fmt in METRICS:
        if key in found:
            name, doc = found[key]
            res = doc["results"]
            lines.append(f"| {label} | {fmt.format(metric(res, key))} | {_spread(key, res)} | {target} "
                         f"| `{name}` |")
    if sched:
        name, doc = sched
        for r in doc["results"]["results"]:
            lines.append(f"| scheduler + machines + PPHandler + mirrors, {r['live']} live "
                         f"| {r['us_per_step']:.0f} us/step | "
                         f"{min(r['all_us_per_step']):.0f} .. {max(r['all_us_per_step']):.0f} "
                         f"| <= 100 us at 256 | `{name}` |")
    if sweep:
        name, doc = sweep
        pts = doc["results"]["sweep"]["points"]
        modes = [k[: -len("_output_tokens_per_s")] for k in pts[0] if k.endswith("_output_tokens_per_s")]
        lines += ["", f"Decode throughput (output tokens/s) by concurrency (`{name}`):", "",
                  "| concurrency | " + " | ".join(modes) + " | "
                  + " | ".join(f"{m} / sync" for m in modes if m != "sync") + " |",
                  "|---" * (1 + len(modes) + len(modes) - 1) + "|"]
        for p in pts:
            cells = [f"{p[m + '_output_tokens_per_s']:.1f}" for m in modes]
            cells += [f"{p[m + '_over_sync']['median']:.2f}" for m in modes if m != "sync"]
            lines.append(f"| {p['concurrency']} | " + " | ".join(cells) + " |")
    for c in contention:
        lines += ["", *contention_table(*c)]
    if serving:
        lines += ["", *serving_table(*serving)]
    for name, doc in ab:
        lines += ["", ab_line(name, doc)]
    extra = [x for x in (sweep, sched, serving) if x] + contention + ab
    cmds = sorted({repo_command(name, doc["command"]) for name, doc in [*found.values(), *extra]})
    machines = sorted({doc["machine"] for _, doc in [*found.values(), *extra]})
    lines += ["", "Machines:", ""] + [f"* {m}" for m in machines]
    lines += ["", "Commands (`MODEL_FOLDER`: a random-weight folder of the model's shape, made by "
              "`python -m runtime.bench.model_folder`; `LLAMA_SERVER`: llama.cpp's llama-server "
              "binary):", ""]
    lines += [f"* `{c}`" for c in cmds]
    return "\n".join(lines)


def repo_command(name: str, command: str) -> str:
    """``command`` as a reader of the repository can run it: the output path (``--json-out`` /
    ``--out``) is the result file ``name`` the table cites (under ``benchmarks/results/``), and
    paths outside the repository become placeholders (``LLAMA_SERVER``, ``MODEL_FOLDER``)."""
    words = command.split()
    for i, w in enumerate(words):
        prev = words[i - 1] if i else ""
        if prev in ("--json-out", "--out") and not w.startswith("benchmarks/"):
            words[i] = f"benchmarks/results/{name}"
        elif w.startswith("/") and w.endswith("llama-server"):
            words[i] = "LLAMA_SERVER"
        elif w.startswith(("/tmp/", "/root/", "/work/")):
            words[i] = "MODEL_FOLDER"
    return " ".join(words)


def contention_table(name: str, doc: dict) -> list[str]:
    """Lines of the stage-contention table (``bench contention``): per torch thread count and
    decode rows, each stage's forward alone and with all stages at once, and the overlapped /
    sync ceiling this implies at twice the rows (two lanes of ``rows``)."""
    res = doc["results"]
    pp = res.get("pp_size", 2)
    ceil = {(c["threads"], c["concurrency"]): c for c in res.get("ceilings", [])}
    out = [f"One stage alone vs all {pp} stages at once, decode-step forward per stage "
           f"(`{name}`); ceiling = overlapped / sync decode throughput this allows at "
           f"concurrency {pp} x rows (sync: the stages take turns on all rows; overlapped: "
           f"{pp} lanes of `rows`, all stages at once); machine: {doc['machine']}:", "",
           "| torch threads | rows | alone (ms per stage) | all at once (ms per stage) "
           "| slow-down | ceiling at concurrency | without contention |",
           "|---|---|---|---|---|---|---|"]
    for p in res["points"]:
        if p["kind"] != "decode":
            continue
        c = ceil.get((p["threads"], pp * p["rows"]))
        ms = lambda xs: " / ".join(f"{1e3 * x:.0f}" for x in xs)  # noqa: E731
        out.append(f"| {p['threads']} | {p['rows']} | {ms(p['alone_s'])} | {ms(p['both_s'])} "
                   f"| {max(p['slowdown']):.2f} | "
                   + (f"{c['ceiling']:.2f} at {c['concurrency']} | "
                      f"{c['ceiling_without_contention']:.2f} |" if c else "- | - |"))
    return out


def serving_table(name: str, doc: dict) -> list[str]:
    """Lines of the CPU serving table (``bench cpu-serve``): output tokens/s of each server at 1
    stream and at the run's concurrency, each over llama.cpp's when it ran, and the ranks' RSS."""
    res, conc = doc["results"], doc["args"]["concurrency"]
    vs = res["ratios"].get("vs_llama_cpp", {})
    kv = doc["args"].get("kv_cache_memory")
    kv_note = (f", ppstate ranks with `--kv-cache-memory {kv}` (a KV cache of {kv} each; `make "
               "serve` sizes it for `--max-num-seqs` x `--max-model-len`, so its ranks are larger)"
               if kv else "")
    out = [f"CPU serving, streamed `/v1/completions`, {doc['args']['input_len']}-token prompts, "
           f"{doc['args']['output_len']} new tokens, greedy, EOS ignored{kv_note} (`{name}`, "
           f"{doc['date'][:16]} UTC); machine: {doc['machine']}:", "",
           f"| server | 1 stream tok/s | {conc} streams tok/s | vs llama.cpp (1 / {conc}) "
           "| rank RSS MiB |", "|---|---|---|---|---|"]
    for srv, r in res["servers"].items():
        if "error" in r:
            out.append(f"| {srv} | failed: {r['error']} | | | |")
            continue
        one, many = r["single"]["output_throughput"], r[f"concurrent_{conc}"]["output_throughput"]
        ratio = " / ".join(f"{x:.2f}" for x in vs[srv]) if srv in vs else "-"
        rss = ", ".join(f"{x:.0f}" for x in r["rss_mib"]["children"] if x > 100) or \
            f"{r['rss_mib']['server']:.0f}"
        out.append(f"| {srv} | {one:.1f} | {many:.1f} | {ratio} | {rss} |")
    pp = {k: v for k, v in res["ratios"].items() if k.endswith("_pp2_over_pp1_concurrent")}
    if pp:
        out += ["", f"PP=2 / PP=1 at {conc} streams: "
                + ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in pp.items()) + "."]
    return out


def ab_line(name: str, doc: dict) -> str:
    """One line of a later ``cpu-serve`` run without llama.cpp: each server's output tokens/s at
    the run's concurrency (median over its rounds) and the PP=2 / PP=1 ratios by round."""
    res, conc = doc["results"], doc["args"]["concurrency"]
    rounds = doc["args"].get("rounds", 1)
    tps = ", ".join(f"{n} {r[f'concurrent_{conc}']['output_throughput']:.1f}"
                    for n, r in res["servers"].items() if "error" not in r)
    by_round = res["ratios"].get("pp2_over_pp1_concurrent_by_round", {})
    ratios = "; ".join(f"{n} / {n.split('-')[0]}-pp1 " + ", ".join(f"{x:.2f}" for x in v)
                       for n, v in by_round.items())
    return (f"Later A/B run (`{name}`, {doc['date'][:16]} UTC, {rounds} round(s), servers taking "
            f"turns): {conc} streams output tok/s (median) {tps}"
            + (f"; PP=2 / PP=1 by round: {ratios}" if ratios else "") + ".")


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the markers replaced by ``block``.

    Raises:
        ValueError: the markers are missing.
    """
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md lacks the markers {START} ... {END}")
    return text[: i + len(START)] + "\n" + block + "\n" + text[j:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 when README.md's table is stale")
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    args = p.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    new = replace_block(text, render(load_results()))
    if args.check:
        if new != text:
            print("README.md benchmark table differs from benchmarks/results/*.json; run "
                  "python benchmarks/readme_table.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
