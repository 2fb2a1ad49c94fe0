"""Resident memory of a plain ``make serve`` (``python -m runtime.serve`` with no other flag than the
port: the embedded model, PP=2, the CPU fast path, the KV cache sized for ``--max-num-seqs`` x
``--max-model-len``), the figure README's serving table (measured with ``--kv-cache-memory 128MB``)
does not give:

    PYTHONPATH=$PWD python benchmarks/serve_rss.py [--port 8917] [--out FILE.json]

RSS (MiB, psutil) of the server process and of each of its descendants (the two ranks, the ranks'
forkserver, multiprocessing's resource tracker), largest first, once the server printed ``ready:``
and again after 8 concurrent greedy completions of 64 tokens; then SIGTERM to its process group.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from runtime.bench.results import write_result


def rss_mib(pid: int) -> dict:
    """``{"server": MiB, "children": [MiB, ...]}`` of ``pid`` and its descendants, largest first."""
    proc = psutil.Process(pid)
    mib = lambda p: round(p.memory_info().rss / 2**20)  # noqa: E731
    return {"server": mib(proc),
            "children": sorted((mib(c) for c in proc.children(recursive=True)), reverse=True)}


def complete(url: str) -> int:
    """One greedy 64-token completion; its HTTP status."""
    body = {"model": "default", "prompt": "Tell me a story " * 8, "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600).status_code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8917)
    p.add_argument("--out", default="benchmarks/results/serve-rss-cpu.json")
    a = p.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "runtime.serve", "--port", str(a.port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)
    try:
        if not any(line.startswith("ready:") for line in server.stdout):
            raise SystemExit("the server exited before it was ready")
        results = {"after_ready": rss_mib(server.pid)}
        with ThreadPoolExecutor(8) as pool:
            results["statuses"] = list(pool.map(complete, [f"http://127.0.0.1:{a.port}"] * 8))
        results["after_8_streams"] = rss_mib(server.pid)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(results)
    write_result(a.out, "serve_rss", results, vars(a), "PYTHONPATH=$PWD python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
