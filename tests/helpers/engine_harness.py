"""Run a real AsyncEngine (real worker processes) on a background event loop for sync tests.

Module-scoped fixtures share one engine across a test module, which keeps the multi-process
suite inside CI's budget; each test submits coroutines with :meth:`EngineThread.run`.
"""

from __future__ import annotations

import asyncio
import threading

from runtime.config import EngineConfig
from runtime.engine import AsyncEngine
from runtime.sampling_params import SamplingParams


class EngineThread:
    """An event loop in a daemon thread holding one started :class:`AsyncEngine`."""

    def __init__(self, config: EngineConfig, start=None) -> None:
        """``start(config)``: the coroutine function that starts the engine (default
        ``AsyncEngine.start``; an ``EngineSupervisor.start`` with restart settings;
        ``runtime.dp.replicas.start_engine`` for ``--dp``)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine: AsyncEngine = self.run((start or AsyncEngine.start)(config), timeout=600)

    def run(self, coro, timeout: float = 300):
        """Run ``coro`` on the engine's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.engine.shutdown(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    # ---- helpers used by tests --------------------------------------------------------------
    async def collect(self, req_id: str, ids: list[int], params: SamplingParams,
                      abort_after: int | None = None, on_token=None) -> dict:
        """Stream one request to the end; abort it after ``abort_after`` tokens if given;
        ``on_token()`` is called (on the loop) after every increment that carries tokens."""
        tokens, text, reason, error, kind = [], "", None, None, None
        async for out in self.engine.add_request(req_id, ids, params):
            tokens += out.new_token_ids
            if on_token is not None and out.new_token_ids:
                on_token()
            text += out.new_text
            reason, error = out.finish_reason or reason, out.error or error
            kind = out.error_kind or kind
            if abort_after is not None and len(tokens) >= abort_after and not out.finished:
                await self.engine.abort(req_id)
        return {"token_ids": tokens, "text": text, "finish_reason": reason, "error": error,
                "error_kind": kind}

    def generate(self, prompts: list[list[int]], params: SamplingParams, prefix: str = "r") -> list[dict]:
        """Run all prompts concurrently; results in prompt order."""
        async def go():
            return await asyncio.gather(*(self.collect(f"{prefix}{i}", p, params)
                                          for i, p in enumerate(prompts)))
        return self.run(go())
