"""Graceful drain on SIGTERM (``--shutdown-timeout S``) and the Kubernetes probes' state.

:class:`DrainState` is shared by the app and the CLI. Once :meth:`DrainState.start` is called the
server is *draining*: :class:`DrainMiddleware` answers every new ``/v1/...`` request with 503
(code ``server_draining``, ``Connection: close``, ``Retry-After``), ``/health`` and
``/health/ready`` with 503 ``{"status": "draining"}``; requests already in flight go on.
:meth:`DrainState.wait_idle` returns when none is left or after the timeout; the CLI then ends
the rest through the engine (each gets the existing shutdown error event and ``[DONE]``) and stops
the HTTP server. ``/health/live`` stays 200 throughout (the process is alive and finishing work: a
liveness probe must not kill it).

In-flight requests are counted here, at the ASGI level, from the moment a ``/v1/...`` request
enters until its response's last byte was sent (a stream is in flight until ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.server.errors import APIError

DRAINING_MESSAGE = ("The server is shutting down and accepts no new requests; retry on another "
                    "replica.")
#: paths that answer 503 "draining" while the server drains (the liveness probe is not one)
DRAINING_HEALTH_PATHS = ("/health", "/health/ready")


class DrainState:
    """Whether the server drains, and how many ``/v1`` requests are in flight."""

    def __init__(self) -> None:
        self.draining = False
        self.started_s: float | None = None   # time.monotonic() of start()
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        """Refuse new requests from now on (idempotent)."""
        if not self.draining:
            self.draining = True
            self.started_s = time.monotonic()

    def enter(self) -> None:
        """A ``/v1`` request started."""
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        """A ``/v1`` request's response ended (sent, failed or the client left)."""
        self.in_flight -= 1
        if self.in_flight <= 0:
            self.in_flight = 0
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most ``timeout_s`` seconds.

        Returns:
            True when every request finished, False on timeout.
        """
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return self.in_flight == 0


def draining_body(path: str) -> dict:
    """The 503 body for ``path`` while draining."""
    if path in DRAINING_HEALTH_PATHS:
        return {"status": "draining", "message": DRAINING_MESSAGE}
    return APIError(DRAINING_MESSAGE, status=503, type="service_unavailable",
                    code="server_draining").body()


class DrainMiddleware:
    """ASGI: 503 for new ``/v1`` requests and readiness while draining; counts ``/v1`` requests."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if self.state.draining and (path.startswith("/v1/") or path in DRAINING_HEALTH_PATHS):
            await send_draining(path, send)
            return
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()


async def send_draining(path: str, send: Send) -> None:
    """Answer one request with 503 and :func:`draining_body`, closing the connection."""
    body = json.dumps(draining_body(path)).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"5"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
