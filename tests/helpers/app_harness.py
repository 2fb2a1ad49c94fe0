"""The server app in process around a real engine: HTTP requests through ``httpx.ASGITransport``.

The app and every request run on the :class:`~engine_harness.EngineThread`'s event loop (the
engine's streams belong to it), so a sync test calls :meth:`AppEngine.post` like a client would,
while the engine's worker processes are real. ``conftest.served_engine`` shares one per session.
"""

from __future__ import annotations

from typing import Any

import httpx

from engine_harness import EngineThread
from runtime.config import EngineConfig
from runtime.server import create_app

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


class AppEngine(EngineThread):
    """An :class:`EngineThread` plus the OpenAI app around its engine."""

    def __init__(self, config: EngineConfig, start=None) -> None:
        super().__init__(config, start)
        self.config = config
        self.app = create_app(self.engine, config)

    def client(self) -> httpx.AsyncClient:
        """A client for this app; build and use it on the engine's loop (inside ``run``).
        App exceptions come back as HTTP 500, as a real server answers them."""
        transport = httpx.ASGITransport(app=self.app, raise_app_exceptions=False)
        return httpx.AsyncClient(transport=transport, base_url="http://app", timeout=300)

    async def apost(self, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
        """POST a JSON body (or raw bytes as JSON) on the engine's loop."""
        async with self.client() as c:
            if isinstance(body, bytes):
                return await c.post(path, content=body, headers={"content-type": "application/json"})
            return await c.post(path, json=body)

    def post(self, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
        """POST from a sync test."""
        return self.run(self.apost(path, body))

    def health(self) -> int:
        """Status code of GET /health."""
        return self.run(self.ahealth())[0]

    async def ahealth(self) -> tuple[int, dict]:
        """(status code, JSON body) of GET /health, on the engine's loop."""
        async with self.client() as c:
            r = await c.get("/health")
            return r.status_code, r.json()
