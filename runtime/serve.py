"""``python -m runtime.serve``: the OpenAI-compatible server over a pipeline of worker processes.

    python -m runtime.serve                      # embedded SmolLM2-135M-Instruct, PP=2, 127.0.0.1:8000
    python -m runtime.serve --model /path/to/hf-folder --pp 4 --port 9000 --api-key sk-local

The port is bound and served before the model loads (a busy port fails at once; ``/health``
answers 503 ``{"status": "loading"}`` meanwhile), the workers show loading progress, and
``ready: http://HOST:PORT`` is printed once requests are served. Ctrl-C / SIGTERM stop
the server and then the engine (with ``--shutdown-timeout S``, after letting the requests in flight
finish for up to S seconds while new ones get 503: a graceful drain). If the engine dies, the server exits with status 1, unless
``--restart-workers`` is given: then it starts fresh workers and serves again (at most
``--max-restarts`` times, see runtime/engine/supervisor.py).
"""

from __future__ import annotations

# first, before the imports below (seconds: torch, FastAPI): a Ctrl-C meanwhile prints
# "interrupted" and exits 130, not a traceback (runtime/interrupt.py); main() restores Ctrl-C
if __name__ == "__main__":
    from runtime.interrupt import quiet_start
    quiet_start()

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from runtime.cli_common import add_engine_flags, engine_config
from runtime.config import EngineConfig
from runtime.server.middleware import DEFAULT_MAX_BODY_BYTES
from runtime.engine.torchrun import run_remote_rank
from runtime.interrupt import started

ENGINE_WATCH_INTERVAL_S = 1.0
#: uvicorn closes idle keep-alive connections after 5 s by default, the same 5 s after which httpx
#: and aiohttp stop reusing a pooled connection; the two timers race, and a request sent on a
#: connection the server closes at that instant fails (ReadError / RemoteProtocolError). 75 s is
#: well past every common client's idle expiry (nginx's keepalive_timeout default is 75 s too).
DEFAULT_KEEP_ALIVE_S = 75.0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and shows every flag's default."""


def build_parser() -> argparse.ArgumentParser:
    """The CLI: server flags plus the shared engine flags (see ``runtime.cli_common``)."""
    p = argparse.ArgumentParser(prog="python -m runtime.serve", description=__doc__.replace("``", "'"),
                                formatter_class=_HelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0 picks a free one)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (else $PPSTATE_API_KEY if set)")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest accepted request body (bytes)")
    s.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                   help="seconds an idle keep-alive connection stays open; longer than clients' "
                   "pool idle expiry (httpx, aiohttp: 5 s), so the server never closes a "
                   "connection the client is reusing at that moment (docs/server.md)")
    s.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="S",
                   help="on SIGTERM / SIGINT: refuse new requests (503, /health 'draining') and "
                   "let those in flight finish for up to S seconds, then end the rest with an "
                   "error event; 0 ends them at once. A second signal ends them at once too")
    s.add_argument("--api-server-count", type=int, default=0, metavar="N",
                   help="run the engine (scheduler, step loop, workers) in its own process and N "
                   "API-server processes (HTTP, tokenizing, response encoding) in front of it, "
                   "sharing the port; 0: everything in this one process")
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split chat replies into reasoning_content (the <think> part) and content")
    s.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level ('info' logs every request)")
    # ---- issue #12: restarts (runtime/engine/supervisor.py) ----
    s.add_argument("--restart-workers", action="store_true",
                   help="after an engine failure (a rank died, hung, stalled or erred) fail the "
                   "in-flight requests, start fresh worker processes and serve again")
    s.add_argument("--max-restarts", type=int, default=3,
                   help="with --restart-workers: restarts over the server's life; then exit 1")
    s.add_argument("--restart-backoff", type=float, default=1.0,
                   help="with --restart-workers: seconds before the first restart, doubled for "
                   "each later one (at most 30 s)")
    add_engine_flags(p)
    p.add_argument("--no-adaptive-lanes", dest="adaptive_lanes", action="store_false",
                   help="fill every in-flight lane (the default on CUDA and the exact CPU path; "
                   "on the fast CPU path adaptive lanes are on: docs/cpu_fast_path.md)")
    # serving: quantized CPU path (tests keep EngineConfig's exact); lanes: default_adaptive_lanes
    p.set_defaults(cpu_path="fast", adaptive_lanes=None)
    return p


def default_adaptive_lanes(args: argparse.Namespace) -> bool:
    """``--adaptive-lanes`` when neither it nor ``--no-adaptive-lanes`` is given: on for the fast
    CPU path (one lane of all decode rows instead of ``pp_size`` lanes of a share each: on the
    2-core machine PP=2 served 1.3-1.5x more tokens per CPU second so, docs/cpu_fast_path.md),
    off on CUDA and where a flag bypasses the fast path (``--cpu-path exact``, ``--tp``,
    ``--spec-tokens``: ``runtime.model.cpu.path_choice``; a model the fast path lacks is only
    found once the checkpoint is opened, and keeps the lanes chosen here)."""
    from runtime.model.cpu.path_choice import exact_reasons
    if args.device == "cuda" or exact_reasons(args.cpu_path, args.tp or 1, args.spec_tokens or 0,
                                              lambda: None):
        return False
    from runtime.device import uses_cuda
    return not uses_cuda(args.device)


def bind_socket(host: str, port: int) -> socket.socket:
    """Listen on host:port now, so a busy port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """``http://HOST:PORT`` of a bound socket (IPv6 hosts in brackets)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server with signal handling left to ``serve`` (so the engine shuts down cleanly)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(config: EngineConfig, args: argparse.Namespace, sock: socket.socket,
                start_engine: Callable[[EngineConfig], Awaitable[Any]] | None = None,
                announce: Callable[[str, str], None] | None = None) -> int:
    """Serve on ``sock`` at once (503 "loading" until the engine is up), start the engine, serve
    until a signal or engine death, stop both.

    Args:
        start_engine: coroutine function that starts the engine (default
            ``runtime.dp.replicas.start_engine``: one pipeline, or ``dp_size`` replicas).
        announce: ``announce(kind, line)`` for the ``loading`` and ``ready`` lines (default:
            print them; an API server of ``--api-server-count`` reports to its main process).

    Returns:
        The exit code: 0 after a signal, 1 when the engine died, 130 when a signal came while the
        model was loading.

    Raises:
        EngineDeadError: the engine failed to start (after the server stopped).
    """
    from runtime.dp.replicas import start_engine as start_dp_or_one
    from runtime.server import create_app
    from runtime.server.drain import DrainState
    from runtime.server.startup import StartupApp, ready_line

    t0 = time.perf_counter()
    dp = f" x {config.dp_size} data-parallel replicas" if config.dp_size > 1 else ""
    say = announce or (lambda kind, line: print(line, flush=True))
    say("loading", f"loading model '{config.model}' over {config.scheduler.pp_size} pipeline "
        f"stage(s){dp} ({config.scheduler.mode} schedule); {url_of(sock, args.host)}/health "
        "answers 503 'loading' until ready ...")
    front = StartupApp()
    server = _Server(uvicorn.Config(front, log_level=args.log_level, timeout_graceful_shutdown=5,
                                    timeout_keep_alive=getattr(args, "timeout_keep_alive",
                                                               DEFAULT_KEEP_ALIVE_S),
                                    lifespan="off", access_log=args.log_level in ("info", "debug")))
    loop = asyncio.get_running_loop()
    if getattr(args, "restart_workers", False):
        from runtime.engine.supervisor import EngineSupervisor
        start_one = start_engine

        async def start_engine(cfg: EngineConfig):  # noqa: F811 - the supervised start
            return await EngineSupervisor.start(cfg, args.max_restarts, args.restart_backoff,
                                                start_engine=start_one)
    load = loop.create_task((start_engine or start_dp_or_one)(config))
    engine: Any = None
    drain = DrainState()
    drain_timeout = float(getattr(args, "shutdown_timeout", 0.0) or 0.0)
    drainer: list[asyncio.Task] = []

    def stop_now() -> None:
        if not server.should_exit:   # the first signal; a second one forces the exit
            print("shutting down: ending open streams, stopping the workers ...", flush=True)
        server.force_exit = server.should_exit
        server.should_exit = True
        if engine is None:
            load.cancel()  # AsyncEngine.start stops the workers it spawned
        else:  # end open streams now (error event + [DONE]) instead of letting uvicorn's
            # graceful shutdown time out and cancel them mid-chunk
            loop.create_task(engine.abort_all("the server is shutting down"))

    def on_signal() -> None:
        if engine is None or drain_timeout <= 0 or drain.draining:
            stop_now()
            return
        drain.start()
        print(f"draining: new requests get 503; {drain.in_flight} in flight get up to "
              f"{drain_timeout:g} s to finish ...", flush=True)
        drainer.append(loop.create_task(drain_then_stop()))

    async def drain_then_stop() -> None:
        finished = await drain.wait_idle(drain_timeout)
        if not finished:
            print(f"drain timeout: ending the {drain.in_flight} request(s) still in flight",
                  flush=True)
        if not server.should_exit:
            stop_now()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    serving = loop.create_task(server.serve(sockets=[sock]))
    try:
        engine = await load
    except BaseException as exc:
        server.should_exit = True
        await serving
        me = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and me is not None and not me.cancelling():
            return 130  # a signal while loading (not a cancellation of serve itself)
        raise
    exit_code = 0
    try:
        front.set_app(create_app(engine, config, api_key=args.api_key,
                                 max_body_bytes=args.max_body_bytes, drain=drain,
                                 reasoning_parser=args.reasoning_parser))

        async def watch() -> None:
            nonlocal exit_code
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.05)
            if server.started:
                say("ready", ready_line(url_of(sock, args.host), engine.model_name, config,
                                        time.perf_counter() - t0))
            while not server.should_exit:
                if not engine.is_alive and not getattr(engine, "restarting", False):
                    print(f"error: the engine died: {getattr(engine, 'error', None)}", file=sys.stderr,
                          flush=True)
                    exit_code = 1
                    server.should_exit = True
                await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)

        watcher = asyncio.create_task(watch())
        try:
            await serving
        finally:
            watcher.cancel()
    finally:
        await engine.shutdown()
    return exit_code


def parse_cli(argv: list[str] | None = None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse and check the flags (exits with status 2 and a message naming the flag on error)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.api_key is None:
        args.api_key = os.environ.get("PPSTATE_API_KEY") or None
    if not 0 <= args.port <= 65535:
        p.error(f"--port: must be in 0..65535, got {args.port}")
    if args.max_body_bytes < 1024:
        p.error(f"--max-body-bytes: must be >= 1024, got {args.max_body_bytes}")
    if not args.shutdown_timeout >= 0:
        p.error(f"--shutdown-timeout: must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.timeout_keep_alive > 0:
        p.error(f"--timeout-keep-alive: must be > 0 seconds, got {args.timeout_keep_alive}")
    if args.max_restarts < 0:
        p.error(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    if args.restart_backoff < 0:
        p.error(f"--restart-backoff: must be >= 0, got {args.restart_backoff}")
    if args.api_server_count < 0:
        p.error(f"--api-server-count: must be >= 0, got {args.api_server_count}")
    if args.adaptive_lanes is None:
        args.adaptive_lanes = default_adaptive_lanes(args)
    config = engine_config(p, args)
    if args.api_server_count and (args.restart_workers or config.dp_size > 1
                                  or config.launcher != "spawn"):
        p.error("--api-server-count: not supported with --restart-workers, --dp > 1 or the "
                "torchrun launcher yet")
    if args.restart_workers and config.dp_size > 1:
        p.error("--restart-workers: not supported with --dp > 1 yet (a dead replica stops the "
                "server; restart it from the supervisor)")
    return args, config


def main(argv: list[str] | None = None) -> int:
    args, config = parse_cli(argv)
    started()   # Ctrl-C raises KeyboardInterrupt again: asyncio.run / the supervisor handle it
    if (status := run_remote_rank(config)) is not None:  # torchrun RANK > 0: a worker, no server
        return status
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    from ppstate.errors import PPStateError
    from runtime.engine import EngineDeadError
    from runtime.model.errors import ModelError
    if args.api_server_count:
        from runtime.server.api_servers import serve_api_servers
        try:
            return serve_api_servers(config, args, sock, url_of(sock, args.host), serve)
        finally:
            sock.close()
    try:
        return asyncio.run(serve(config, args, sock))
    except (EngineDeadError, PPStateError, ModelError, ValueError) as exc:  # model / flag problems found late
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model was loading
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
