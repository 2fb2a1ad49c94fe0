"""EngineSupervisor: serve again after an engine failure (``--restart-workers``, issue #12).

When a rank dies, freezes, stalls or reports an error, the :class:`~runtime.engine.AsyncEngine`
fails every in-flight request and stops its worker processes; the KV cache and the scheduler
state are gone with them. The supervisor then starts a fresh engine (new worker processes, the
model loaded again) with the same configuration and routes new requests to it. Nothing is
replayed: requests that were in flight got their error (HTTP 503 / an SSE error event), and
their clients may retry.

Restarts are bounded: at most ``max_restarts`` over the server's life, the k-th (k = 1, 2, ...)
after ``backoff_s * 2**(k-1)`` seconds (capped at :data:`MAX_BACKOFF_S`); a restart whose engine
fails to start counts as one. Once they are used up the supervisor stays dead (``is_alive`` False,
``restarting`` False) and the server exits with status 1 as without ``--restart-workers``, so an
outer supervisor (systemd, Kubernetes) takes over. While restarting, ``/health`` answers 503
``{"status": "restarting"}`` and requests 503 ``engine_restarting`` (header ``Retry-After``).

The supervisor has the engine's interface as the server uses it (``add_request``, ``abort``,
``abort_all``, ``is_alive``, ``error``, ``stats``, ``tokenizer``, ``model_name``,
``shutdown``), so :func:`runtime.server.create_app` takes it in place of an engine. ``stats()``
adds ``engine_restarts_total`` and keeps the engine counters (steps, tokens, busy seconds)
cumulative across restarts.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from runtime.config import EngineConfig
from runtime.engine.async_engine import AsyncEngine
from runtime.engine.errors import EngineDeadError

MAX_BACKOFF_S = 30.0  # longest wait before one restart (seconds)
WATCH_INTERVAL_S = 0.2  # seconds between two looks at the engine's liveness
#: counters of ``AsyncEngine.stats()`` summed over the engines of the server's life
CUMULATIVE = ("steps_total", "generated_tokens_total")


class EngineSupervisor:
    """One live engine at a time, restarted after failures.

    Create with ``await EngineSupervisor.start(config, max_restarts, backoff_s)``.

    Args:
        engine: the first, started engine.
        config: its configuration (each restart uses it again).
        max_restarts: restarts allowed over the supervisor's life (>= 0).
        backoff_s: seconds before the first restart; doubled for each later one.
        start_engine: coroutine function starting an engine (default ``AsyncEngine.start``).
    """

    def __init__(self, engine: AsyncEngine, config: EngineConfig, max_restarts: int,
                 backoff_s: float,
                 start_engine: Callable[[EngineConfig], Awaitable[AsyncEngine]] | None = None) -> None:
        self.engine, self.config = engine, config
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self._start_engine = start_engine or AsyncEngine.start
        self.restarts = 0                       # restarts attempted (failed starts included)
        self.restarting = False
        self.failures: list[str] = []           # every engine failure, in order
        self._closed = False
        self._base: dict[str, Any] = {k: 0 for k in CUMULATIVE}
        self._base_busy = [0.0] * config.world_size  # [pp x tp] busy seconds of earlier engines
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    @classmethod
    async def start(cls, config: EngineConfig, max_restarts: int = 3, backoff_s: float = 1.0,
                    start_engine=None) -> "EngineSupervisor":
        """Start the first engine and watch it.

        Raises:
            EngineDeadError: the first engine failed to start (no restart is tried: a
                configuration that cannot start will not start the next time either).
        """
        engine = await (start_engine or AsyncEngine.start)(config)
        return cls(engine, config, max_restarts, backoff_s, start_engine)

    # ---- the engine interface ----------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while an engine serves (False while restarting and once dead for good)."""
        return not self._closed and not self.restarting and self.engine.is_alive

    @property
    def error(self) -> str | None:
        """Why the current engine died (None while alive)."""
        return self.engine.error

    @property
    def tokenizer(self):
        """The current engine's tokenizer (the same model at every restart)."""
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        """The served model name."""
        return self.engine.model_name

    def add_request(self, req_id, prompt_token_ids, params) -> AsyncIterator:
        """:meth:`AsyncEngine.add_request` of the current engine.

        Raises:
            EngineDeadError: restarting, or dead for good (besides the engine's own errors).
        """
        if self.restarting:
            raise EngineDeadError(f"the engine is restarting after a failure: {self.error}")
        return self.engine.add_request(req_id, prompt_token_ids, params)

    async def abort(self, req_id: str) -> None:
        """Abort ``req_id`` on the current engine (idempotent; a request of a failed engine has
        already ended)."""
        await self.engine.abort(req_id)

    async def abort_all(self, message: str) -> None:
        """Abort every live request of the current engine with ``message``."""
        await self.engine.abort_all(message)

    def stats(self) -> dict:
        """The current engine's ``stats()`` with counters summed over every engine so far, plus
        ``engine_restarts_total``."""
        s = dict(self.engine.stats())
        for k in CUMULATIVE:
            s[k] += self._base[k]
        s["rank_busy_seconds"] = [a + b for a, b in zip(self._base_busy, s["rank_busy_seconds"])]
        s["engine_restarts_total"] = self.restarts
        return s

    async def shutdown(self) -> None:
        """Stop watching (an ongoing restart included) and shut the current engine down."""
        self._closed = True
        self._watch.cancel()
        await asyncio.gather(self._watch, return_exceptions=True)
        await self.engine.shutdown()

    # ---- restarts ----------------------------------------------------------------------------
    def backoff_for(self, k: int) -> float:
        """Seconds to wait before restart ``k`` (1-based)."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** (k - 1))

    async def _watch_loop(self) -> None:
        while not self._closed:
            if self.engine.is_alive:
                await asyncio.sleep(WATCH_INTERVAL_S)
                continue
            self.failures.append(self.engine.error or "engine stopped")
            if self.restarts >= self.max_restarts:
                print(f"error: the engine failed and all {self.max_restarts} restart(s) are used "
                      f"up: {self.failures[-1]}", file=sys.stderr, flush=True)
                return
            self.restarting = True
            try:
                await self._restart()
            finally:
                self.restarting = False
            if not self.engine.is_alive:        # no restart started an engine: dead for good
                return

    async def _restart(self) -> None:
        """Stop the failed engine, wait the backoff, start a new one (retried, each attempt
        counted, until one starts or the restarts are used up)."""
        old = self.engine
        await old.shutdown()                    # its workers are gone after this
        while True:
            self.restarts += 1
            wait = self.backoff_for(self.restarts)
            print(f"engine failed ({self.failures[-1]}); restart {self.restarts}/"
                  f"{self.max_restarts} in {wait:.1f} s", file=sys.stderr, flush=True)
            await asyncio.sleep(wait)
            try:
                new = await self._start_engine(self.config)
                self._fold_counters(old)        # the old engine's counters, once, at the swap
                self.engine = new
                print(f"engine restarted ({self.restarts}/{self.max_restarts})", file=sys.stderr,
                      flush=True)
                return
            except Exception as exc:  # noqa: BLE001 - EngineDeadError, or a late config error
                self.failures.append(str(exc))
                if self.restarts >= self.max_restarts:
                    print(f"error: restart failed and all {self.max_restarts} restart(s) are used "
                          f"up: {exc}", file=sys.stderr, flush=True)
                    return              # self.engine stays the dead one: is_alive False for good

    def _fold_counters(self, engine: AsyncEngine) -> None:
        s = engine.stats()
        for k in CUMULATIVE:
            self._base[k] += s[k]
        self._base_busy = [a + b for a, b in zip(self._base_busy, s["rank_busy_seconds"])]
