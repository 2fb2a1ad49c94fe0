"""Data parallelism: N independent PP pipelines behind one engine interface (``--dp N``).

Each replica is a complete :class:`~runtime.engine.AsyncEngine`: its own ``pp_size`` worker
processes (so ``dp_size x pp_size`` rank processes in all), its own scheduler, KV cache, slot table
and step loop. Replicas share nothing but this router, which lives in the API server's process:

* **Routing.** A new request goes to the least-loaded live replica, load = requests running +
  waiting in that replica's scheduler; ties go round-robin (so sequential requests alternate).
  Nothing of a request ever crosses replicas: its KV cache, mirrors and deferred broadcasts stay
  inside one pipeline, so every per-pipeline invariant holds unchanged.
* **Aborts** (client disconnects, ``abort_all``) reach the replica that owns the request (the
  router remembers the owner until the request's stream ends).
* **Request ids** are unique across the server: an id live on any replica is rejected (400,
  field ``request_id``), as with one pipeline.
* **Health.** The engine is alive while every replica is; the first replica to die fails its own
  requests (as a single engine does) and makes the whole engine report dead, so ``/health``
  answers 503 naming it and ``runtime.serve`` exits with status 1.
* **Stats** are per replica (``stats()["replicas"]``, exported with a ``replica`` label by
  :mod:`runtime.dp.metrics`) and summed (the top-level keys, same names as one engine's).

Only the spawn launcher is supported: under torchrun every process is one rank of one pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from runtime.config import EngineConfig
from runtime.engine import AsyncEngine, EngineDeadError, RequestRejected
from runtime.engine.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

#: stats() keys summed over replicas (counts, tokens, seconds, blocks)
_SUMMED = ("num_running", "num_waiting", "steps_total", "generated_tokens_total",
           "active_seconds", "kv_blocks_total", "kv_blocks_free", "prefix_cache_query_tokens",
           "prefix_cache_hit_tokens", "num_preemptions", "kv_blocks_cached",
           "prefill_tokens_computed", "spec_proposed_tokens",
           "spec_accepted_tokens", "spec_decode_rows", "discarded_result_rows")


async def start_engine(config: EngineConfig) -> Any:
    """An :class:`AsyncEngine` for ``dp_size == 1``, else a :class:`ReplicatedEngine`.

    Raises:
        EngineDeadError: a worker failed while starting.
    """
    if config.dp_size == 1:
        return await AsyncEngine.start(config)
    return await ReplicatedEngine.start(config)


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica ``index``'s own config: one pipeline (``dp_size`` 1); a trace directory gets a
    ``replica<index>`` subdirectory so each pipeline records its own run."""
    update: dict[str, Any] = {"dp_size": 1}
    if config.trace_dir:
        update["trace_dir"] = str(Path(config.trace_dir) / f"replica{index}")
    return config.model_copy(update=update)


class ReplicatedEngine:
    """``dp_size`` independent pipelines behind the :class:`AsyncEngine` interface
    (``add_request``, ``abort``, ``abort_all``, ``shutdown``, ``is_alive``, ``error``,
    ``stats``, ``model_name``, ``tokenizer``, ``config``).

    Create with ``await ReplicatedEngine.start(config)``.

    Attributes:
        replicas: the started engines, index = replica id.
    """

    def __init__(self, config: EngineConfig, replicas: list[AsyncEngine]) -> None:
        self.config = config
        self.replicas = replicas
        self.model_name = replicas[0].model_name
        self.tokenizer = replicas[0].tokenizer
        self._owner: dict[str, int] = {}  # live req_id -> replica index
        self._next = 0                     # round-robin start for ties
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig) -> "ReplicatedEngine":
        """Start every replica concurrently; if one fails, stop those that started.

        Raises:
            ValueError: ``dp_size`` > 1 with the torchrun launcher (names ``--dp``).
            EngineDeadError: a replica failed to start (message names it).
        """
        if config.launcher == "torchrun":
            raise ValueError("--dp: data parallelism needs the spawn launcher; under torchrun "
                             "run one server per pipeline")
        tasks = [asyncio.ensure_future(AsyncEngine.start(replica_config(config, i)))
                 for i in range(config.dp_size)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        started = [r for r in results if isinstance(r, AsyncEngine)]
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(e.shutdown() for e in started), return_exceptions=True)
            i, exc = failed[0]
            if not isinstance(exc, Exception):
                raise exc  # cancellation
            raise EngineDeadError(f"replica {i} failed to start: {exc}") from exc
        return cls(config, started)

    async def shutdown(self) -> None:
        """Stop every replica (concurrently)."""
        self._closed = True
        await asyncio.gather(*(e.shutdown() for e in self.replicas), return_exceptions=True)

    # ---- health --------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        """True while every replica is alive."""
        return not self._closed and all(e.is_alive for e in self.replicas)

    @property
    def error(self) -> str | None:
        """Why the engine is dead: the first dead replica and its error (None while alive)."""
        for i, e in enumerate(self.replicas):
            if not e.is_alive:
                return f"replica {i}: {e.error or 'shut down'}"
        return "engine is shut down" if self._closed else None

    def health_detail(self) -> list[dict[str, Any]]:
        """Per replica: ``{"replica", "alive", "error", "num_running", "num_waiting"}``."""
        return [{"replica": i, "alive": e.is_alive, "error": e.error,
                 "num_running": e.sched.num_running, "num_waiting": e.sched.num_waiting}
                for i, e in enumerate(self.replicas)]

    # ---- requests ------------------------------------------------------------------------------
    def pick_replica(self) -> int:
        """Index of the least-loaded live replica (running + waiting requests); ties go to the
        first at or after the round-robin cursor, which then moves past it.

        Raises:
            EngineDeadError: no replica is alive.
        """
        n = len(self.replicas)
        live = [i for i in range(n) if self.replicas[i].is_alive]
        if not live:
            raise EngineDeadError(self.error or "engine is shut down")
        best = min(live, key=lambda i: (self.load(i), (i - self._next) % n))
        self._next = (best + 1) % n
        return best

    def load(self, index: int) -> int:
        """Requests running + waiting in replica ``index``'s scheduler."""
        s = self.replicas[index].sched
        return s.num_running + s.num_waiting

    def owner_of(self, req_id: str) -> int | None:
        """The replica serving live request ``req_id`` (None: unknown or ended)."""
        return self._owner.get(req_id)

    def add_request(self, req_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, fork_of: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request on the least-loaded replica (a fork on its parent's, whose prompt
        blocks it shares); returns its stream of increments.

        Raises:
            EngineDeadError: the engine (some replica) is dead or shut down.
            RequestRejected: as :meth:`AsyncEngine.add_request`; also an id live on any replica.
            RequestFailure: as :meth:`AsyncEngine.add_request`.
        """
        if not self.is_alive:
            raise EngineDeadError(self.error or "engine is shut down")
        if req_id is not None and req_id in self._owner:
            owner = self.replicas[self._owner[req_id]]
            if owner.sched.is_live(req_id) or req_id in owner._streams:
                raise RequestRejected("request_id", f"request id {req_id!r} is already in use by "
                                      "a live request")
            del self._owner[req_id]  # ended without its stream being read to the end
        index = self._owner.get(fork_of, -1) if fork_of is not None else -1
        if index < 0:
            index = self.pick_replica()
        engine = self.replicas[index]
        inner = engine.add_request(req_id, prompt_token_ids, params, fork_of=fork_of)
        if req_id is None:  # the engine made one up; it is the first increment's req_id
            return self._routed(index, None, inner)
        self._owner[req_id] = index
        return self._routed(index, req_id, inner)

    async def _routed(self, index: int, req_id: str | None,
                      inner: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        try:
            async for out in inner:
                if req_id is None:
                    req_id = out.req_id
                    self._owner[req_id] = index
                yield out
        finally:
            if req_id is not None and self._owner.get(req_id) == index:
                del self._owner[req_id]
            await inner.aclose()  # a consumer that left early: the replica aborts the request

    async def abort(self, req_id: str) -> None:
        """Abort ``req_id`` on its replica (idempotent; unknown ids are ignored)."""
        index = self._owner.get(req_id)
        if index is not None:
            await self.replicas[index].abort(req_id)

    async def abort_all(self, message: str) -> None:
        """Abort every live request on every replica (see :meth:`AsyncEngine.abort_all`)."""
        await asyncio.gather(*(e.abort_all(message) for e in self.replicas))

    # ---- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Totals under one engine's keys plus ``replicas`` (each replica's own ``stats()``)
        and ``dp_size``.

        Totals: counts and seconds are summed; ``rank_busy_seconds[r]`` sums stage ``r`` of
        every replica (rank ``r`` of ``pp x tp``); ``bubble_fraction`` = 1 - sum(busy) / (ranks *
        sum(active seconds));
        ``prefix_cache_hit_rate`` = summed hits / summed queries.
        """
        per = [e.stats() for e in self.replicas]
        pp, n = self.config.scheduler.pp_size, self.config.world_size   # n: ranks (pp x tp)
        total: dict[str, Any] = {k: sum(s[k] for s in per) for k in _SUMMED if k in per[0]}
        total["rank_busy_seconds"] = [sum(s["rank_busy_seconds"][r] for s in per) for r in range(n)]
        if "dropped_deferred_rows" in per[0]:
            total["dropped_deferred_rows"] = [sum(s["dropped_deferred_rows"][r] for s in per)
                                              for r in range(n)]
        active = total.get("active_seconds", 0.0)
        busy = sum(total["rank_busy_seconds"])
        total["bubble_fraction"] = max(0.0, 1.0 - busy / (n * active)) if active > 0 else 0.0
        total["pp_size"], total["tp_size"] = pp, self.config.tp_size
        if "prefix_cache_query_tokens" in total:
            q = total["prefix_cache_query_tokens"]
            total["prefix_cache_hit_rate"] = total["prefix_cache_hit_tokens"] / q if q else 0.0
        total["dp_size"] = len(self.replicas)
        total["replicas"] = per
        return total
