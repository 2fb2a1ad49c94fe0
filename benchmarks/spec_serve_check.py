"""Serve with and without speculation and compare what an OpenAI client receives (issue #33).

Starts ``python -m runtime.serve`` twice on one model (``--spec-tokens 0``, then ``--spec-tokens
K``), sends the same greedy requests through the ``openai`` client to each (chat and completions,
streamed and not), and writes one JSON: per request whether the text is identical, the server's
speculation counters from ``/metrics`` (drafts proposed / accepted), and each server's wall time
for the batch.

Usage (a model folder from ``runtime.bench.model_folder --tokenizer default``, which needs the
embedded GGUF; with ``--tokenizer word``, pass ``--word-prompts``)::

    python benchmarks/spec_serve_check.py --model FOLDER --device cuda --dtype float32 \\
        --spec-tokens 4 --out spec-serve.json

On the CPU both servers serve ``--cpu-path exact`` (``--cpu-path fast`` to change it): speculation
always serves the exact fp32 path, and a plain server would otherwise serve the quantized fast one,
so the comparison (texts, margins, wall times) would pair two kernel paths. Each run's JSON
records the ``CPU path:`` line its server printed (``path``; None on CUDA).

Where two outputs part, the JSON names the token index and the top-1 / top-2 logprob margin each
run saw there: random weights loop on one token until another overtakes it, and that crossing is a
near-tie by construction, so a verify row's rounding can move it by a token. Exit status 0 when
every response is identical or parts only at a near-tie (both margins <= ``--tie-tolerance``)
and the K server accepted drafts, 1 otherwise.
Raises ``RuntimeError`` when a server does not print its ``ready:`` line within ``--ready-timeout``
seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "Repeat this list exactly three times: apple, banana, cherry, date, elderberry.",
    "Copy the sentence: the quick brown fox jumps over the lazy dog. Again: the quick brown fox",
    "Count: one two three four five six seven eight nine ten one two three four five",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]


def server_command(args, spec: int, port: int) -> list[str]:
    """The ``runtime.serve`` command line of the ``--spec-tokens spec`` server.

    On the CPU both servers get ``--cpu-path`` (default exact): a plain server would serve the
    quantized fast path while speculation serves the exact fp32 path, so the pair would compare
    two kernel paths, not speculation on vs off."""
    cmd = [sys.executable, "-m", "runtime.serve", "--model", args.model, "--device", args.device,
           "--dtype", args.dtype, "--pp", str(args.pp), "--port", str(port),
           "--max-model-len", "1024",
           "--spec-tokens", str(spec)]
    if args.device == "cpu":
        cmd += ["--cpu-path", args.cpu_path]
    return cmd


def start_server(args, spec: int, port: int, log: Path) -> subprocess.Popen:
    """Start one server; return once it prints ``ready:`` (RuntimeError if it exits or times out)."""
    cmd = server_command(args, spec, port)
    fh = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if "ready: " in log.read_text():
            return proc
        if proc.poll() is not None:
            raise RuntimeError(f"server (--spec-tokens {spec}) exited: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server (--spec-tokens {spec}) not ready in {args.ready_timeout} s")


def served_path(log: Path) -> str | None:
    """The server's ``CPU path: ...`` startup line (without the prefix), None if it printed none."""
    m = re.search(r"^CPU path: (.*)$", log.read_text(), re.M)
    return m.group(1) if m else None


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


# For a folder with the word-level tokenizer (``t0`` .. ``tN``, no chat template): repetitive
# and plain token-id prompts as text, completions only.
WORD_PROMPTS = [" ".join(f"t{100 + i % 7}" for i in range(40)),
                " ".join(f"t{3000 + (i * 37) % 101}" for i in range(30)),
                " ".join(f"t{500 + i}" for i in range(12)) * 2, "t42 t43 t44 t45"]


def _chat_tokens(content) -> list[tuple[str, float]]:
    """``(token, top-1 minus top-2 logprob)`` per emitted token of a chat logprobs block."""
    out = []
    for t in content or []:
        tops = sorted((x.logprob for x in t.top_logprobs), reverse=True)
        out.append((t.token, tops[0] - tops[1] if len(tops) > 1 else float("inf")))
    return out


def run_requests(port: int, max_tokens: int, word: bool) -> tuple[list[dict], float]:
    """Chat (plain, streamed) and completion requests with logprobs (top 2) for every prompt
    (``word``: completions only, :data:`WORD_PROMPTS`): each response's text and
    ``(token, margin)`` list, and the wall time (seconds)."""
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    model = client.models.list().data[0].id
    greedy = dict(model=model, temperature=0, max_tokens=max_tokens)
    chat = dict(greedy, logprobs=True, top_logprobs=2)
    res, t0 = [], time.perf_counter()
    for p in WORD_PROMPTS if word else PROMPTS:
        if word:
            res.append(_completion(client, p, greedy))
            continue
        msgs = [{"role": "user", "content": p}]
        r = client.chat.completions.create(messages=msgs, **chat).choices[0]
        res.append({"text": r.message.content, "tokens": _chat_tokens(r.logprobs.content)})
        text, toks = "", []
        for c in client.chat.completions.create(messages=msgs, stream=True, **chat):
            if c.choices:
                text += c.choices[0].delta.content or ""
                toks += _chat_tokens(c.choices[0].logprobs.content if c.choices[0].logprobs else [])
        res.append({"text": text, "tokens": toks})
        res.append(_completion(client, p, greedy))
    return res, time.perf_counter() - t0


def _completion(client, prompt: str, greedy: dict) -> dict:
    r = client.completions.create(prompt=prompt, logprobs=2, **greedy).choices[0]
    tops = [sorted(d.values(), reverse=True) for d in r.logprobs.top_logprobs]
    return {"text": r.text, "tokens": [(t, v[0] - v[1] if len(v) > 1 else float("inf"))
                                       for t, v in zip(r.logprobs.tokens, tops)]}


def compare(off: dict, on: dict) -> dict:
    """Identical, or where the two greedy outputs part: the token index and the top-1 / top-2
    logprob margin (nats) each run saw there (a near-tie when both are small); and the largest
    change of that margin between the runs over the tokens before (nats: the numeric noise
    between the two servers' forwards)."""
    a, b = off["tokens"], on["tokens"]
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), min(len(a), len(b)))
    noise = max((abs(x[1] - y[1]) for x, y in zip(a[:i], b[:i]) if x[1] != float("inf")),
                default=0.0)
    if off["text"] == on["text"]:
        return {"identical": True, "margin_change_max": noise}
    return {"identical": False, "first_diff_token": i, "margin_change_max": noise,
            "margin_off": a[i][1] if i < len(a) else None,
            "margin_spec": b[i][1] if i < len(b) else None}


def spec_counters(port: int) -> dict[str, float]:
    """``ppstate_spec_*_total`` counters from the server's ``/metrics``."""
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(ppstate_spec_\w+_total)(?:\{[^}]*\})? ([0-9.eE+-]+)$", body, re.M)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (``main``'s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cpu-path", default="exact", choices=["exact", "fast"],
                    help="--device cpu: the kernel path of both servers (speculation serves the "
                         "exact one whatever is asked, so fast pairs two kernel paths)")
    ap.add_argument("--pp", type=int, default=1,
                    help="pipeline stages of both servers (2 on one GPU stages through gloo)")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8231)
    ap.add_argument("--ready-timeout", type=float, default=180.0)
    ap.add_argument("--out", default="spec-serve.json")
    ap.add_argument("--word-prompts", action="store_true",
                    help="the folder has the word-level tokenizer (no chat template): token-id "
                         "text prompts, completions only")
    ap.add_argument("--tie-tolerance", type=float, default=1e-3,
                    help="nats: outputs may part only where both runs' top-1 / top-2 margin is "
                         "at most this (a near-tie; rounding of a different GEMM layout)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out_dir = Path(args.out).resolve().parent
    results = {}
    for spec in (0, args.spec_tokens):
        log = out_dir / f"spec-serve-k{spec}.log"
        proc = start_server(args, spec, args.port + spec, log)
        try:
            resp, wall = run_requests(args.port + spec, args.max_tokens, args.word_prompts)
            results[spec] = {"responses": resp, "wall_s": wall, "path": served_path(log),
                             "metrics": spec_counters(args.port + spec)}
        finally:
            stop_server(proc)
    off, on = results[0], results[args.spec_tokens]
    diffs = [compare(a, b) for a, b in zip(off["responses"], on["responses"])]
    parted = [d for d in diffs if not d["identical"]]
    worst = max((max(d["margin_off"] or 0, d["margin_spec"] or 0) for d in parted), default=0.0)
    accepted = on["metrics"].get("ppstate_spec_accepted_tokens_total", 0.0)
    summary = {"spec_tokens": args.spec_tokens, "dtype": args.dtype, "device": args.device,
               "responses": len(diffs), "identical": len(diffs) - len(parted),
               "parted": parted, "largest_margin_where_parted": worst,
               "margin_change_max_before_parting": max(d["margin_change_max"] for d in diffs),
               "near_tie_tolerance": args.tie_tolerance, "accepted_drafts": accepted,
               "wall_s_off": off["wall_s"], "wall_s_spec": on["wall_s"], "runs": results}
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    print("metrics with speculation:", on["metrics"])
    return 0 if worst <= args.tie_tolerance and accepted > 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
