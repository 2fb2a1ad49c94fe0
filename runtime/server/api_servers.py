"""``--api-server-count N``: N API-server processes in front of one engine-core process.

One asyncio process that does HTTP, tokenizing, scheduling, detokenizing and the JSON / SSE
encoding of every chunk is bound by one core long before a GPU is. With ``--api-server-count N``
the server's main process only supervises:

* one engine-core process (:mod:`runtime.server.engine_core`): the AsyncEngine, i.e. scheduler,
  step loop, worker processes, detokenizing and stop strings;
* N API-server processes, each running the same app as the single-process server over a
  :class:`~runtime.server.remote_engine.RemoteEngine`: HTTP parsing, request validation,
  tokenizing and chat templates, and the encoding of every response and SSE chunk. They share the
  one listening socket the main process bound (the kernel hands each new connection to one of
  them), so clients see one address.

Requests and increments travel over ZMQ (ipc sockets) as msgpack. Every API server answers
``/health`` (503 ``loading`` until the core's engine is up), ``/metrics`` (the engine's counters
relayed by the core; the request histograms are per API server, so a scrape sees the one that
answered) and drains on SIGTERM like the single-process server. The main process prints
``ready:`` once every API server serves; on SIGTERM / SIGINT it forwards SIGTERM to the API
servers (each drains for ``--shutdown-timeout``), then stops the core. Exit status 1 when the
engine or an API server failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import time

from runtime.config import EngineConfig

POLL_S = 0.1
CORE_STOP_S = 30.0


def frontend_main(config: EngineConfig, args: argparse.Namespace, sock: socket.socket, index: int,
                  in_addr: str, out_addr: str, ready_q, serve,
                  supervisor_pid: int | None = None) -> None:
    """Process entry point of API server ``index`` (spawn target); ``serve`` is
    :func:`runtime.serve.serve` (passed in, pickled by name, so this module does not import the
    CLI that imports it). It exits when process ``supervisor_pid`` ends (None: not watched)."""
    import asyncio

    from runtime.engine.rank_process import watch_engine
    from runtime.server.remote_engine import RemoteEngine
    os.setpgid(0, 0)   # a Ctrl-C on the terminal reaches the main process only
    if supervisor_pid is not None:   # own process group: a SIGKILL of the supervisor left it
        watch_engine(supervisor_pid, who=f"API server {index}", watched="supervisor")  # serving

    engines: list[RemoteEngine] = []

    async def start(cfg: EngineConfig) -> RemoteEngine:
        engines.append(await RemoteEngine.start(cfg, index, in_addr, out_addr))
        return engines[-1]

    def announce(kind: str, line: str) -> None:
        if kind == "ready":   # the supervisor prints one ready line for all API servers
            ready_q.put((index, engines[-1].model_name))
        elif kind != "loading":
            print(line, flush=True)
    try:
        code = asyncio.run(serve(config, args, sock, start_engine=start, announce=announce))
    except Exception as exc:  # noqa: BLE001 - the engine failed to start: reported, exit 1
        print(f"error: API server {index}: {exc}", file=sys.stderr, flush=True)
        code = 1
    sys.exit(code)


class _Signals:
    """SIGINT / SIGTERM counted (the main process polls instead of being interrupted)."""

    def __init__(self) -> None:
        self.count = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on)

    def _on(self, signum, frame) -> None:  # noqa: ARG002
        self.count += 1


def _how(code: int | None) -> str:
    """``"killed by SIGKILL"`` / ``"exit status 1"`` from a ``Process.exitcode``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def who_exited(core, fronts) -> str:
    """Which of the engine core and the API servers ended, and how, e.g. ``"API server 0 (pid
    8378) exited: killed by SIGKILL"``; the core counts while it is not alive, an API server when
    its exit code is set and not 0 (``core`` / ``fronts``: ``multiprocessing.Process``)."""
    gone = [(f"engine core (pid {core.pid})", core.exitcode)] if not core.is_alive() else []
    gone += [(f"API server {k} (pid {p.pid})", p.exitcode) for k, p in enumerate(fronts)
             if p.exitcode not in (None, 0)]
    return "; ".join(f"{name} exited: {_how(code)}" for name, code in gone) or \
        "the engine core or an API server exited"


def serve_api_servers(config: EngineConfig, args: argparse.Namespace, sock: socket.socket,
                      url: str, serve) -> int:
    """Run the engine core and ``args.api_server_count`` API servers until a signal or a failure;
    each API server runs ``serve`` (:func:`runtime.serve.serve`) around a remote engine.

    Returns:
        The exit status: 0 after a signal, 1 when the engine or an API server failed.
    """
    from runtime.server.engine_core import core_main
    from runtime.server.startup import ready_line
    from runtime.transport import ipc_address
    n = args.api_server_count
    ctx = mp.get_context("spawn")
    in_addr = ipc_address("core-in")
    out_addrs = [ipc_address(f"api-{k}") for k in range(n)]
    signals = _Signals()
    print(f"loading model '{config.model}' over {config.scheduler.pp_size} pipeline stage(s) in an "
          f"engine-core process, {n} API server process(es); {url}/health answers 503 'loading' "
          "until ready ...", flush=True)
    t0 = time.perf_counter()
    # the supervisor's pid, not the children's getppid(): a child still importing when the
    # supervisor is killed would read init's pid by the time it watches
    me = os.getpid()
    core = ctx.Process(target=core_main, args=(config, in_addr, out_addrs, me),
                       name="ppstate-engine-core")
    core.start()
    ready_q = ctx.Queue()
    fronts = [ctx.Process(target=frontend_main, name=f"ppstate-api-{k}",
                          args=(config, args, sock, k, in_addr, out_addrs[k], ready_q, serve, me))
              for k in range(n)]
    for p in fronts:
        p.start()
    sock.close()   # each API server holds its own copy of the listening socket
    ready: dict[int, str] = {}   # API server -> the model name it serves
    forwarded, failed = 0, False
    while any(p.is_alive() for p in fronts):
        try:
            index, model_name = ready_q.get(timeout=POLL_S)
            ready[index] = model_name
            if len(ready) == n:
                print(ready_line(url, model_name, config, time.perf_counter() - t0,
                                 f"{n} API server processes {[p.pid for p in fronts]}, "
                                 f"engine core {core.pid}, "), flush=True)
        except queue.Empty:
            pass
        broken = (not core.is_alive() and not forwarded) or any(
            p.exitcode not in (None, 0) for p in fronts)
        if broken and not failed:
            failed = True
            print(f"error: {who_exited(core, fronts)}; stopping", file=sys.stderr, flush=True)
        if (signals.count > forwarded or failed) and forwarded < 2:
            forwarded += 1
            for p in fronts:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGTERM)
            if failed:
                forwarded = 2
    for p in fronts:
        p.join()
    if core.is_alive():
        os.kill(core.pid, signal.SIGTERM)
        core.join(CORE_STOP_S)
        if core.is_alive():
            core.kill()
            core.join(5)
    codes = [p.exitcode for p in fronts]
    return 1 if failed or any(c != 0 for c in codes) or core.exitcode not in (0, None) else 0
