"""The ASGI front the CLI serves from the moment its port is bound.

Loading the model takes tens of seconds; an orchestrator probing ``/health`` in that time must be
able to tell "starting" from "dead". :class:`StartupApp` answers every HTTP request with 503 and a
JSON body until the real app (built once the engine is up) is installed with :meth:`set_app`:

* ``GET /health`` and ``GET /health/ready`` -> ``503 {"status": "loading", "message": ...}``
* ``GET /health/live`` -> ``200 {"status": "alive", "message": ...}`` (loading is not a failure)
* anything else  -> ``503 {"error": {"message", "type": "service_unavailable", "param": null,
  "code": "model_loading"}}`` (the OpenAI error shape of :mod:`runtime.server.errors`).

After :meth:`set_app` every request goes to the real app, whose ``/health`` answers 200 while the
engine lives and 503 ``engine_dead`` after a failure.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runtime.config import EngineConfig
from runtime.server.errors import APIError

LOADING_MESSAGE = "The model is loading; the server accepts requests once it is ready."


def ready_line(url: str, model_name: str, config: EngineConfig, up_s: float,
               processes: str = "") -> str:
    """The ``ready:`` line ``python -m runtime.serve`` prints once requests are served: the URL,
    the served model name, pp / tp / dp, then ``processes`` (``--api-server-count``: which
    processes serve, ending ``", "``) and the seconds since start. One function, so that the
    single-process server and the API servers' supervisor say the same things."""
    return (f"ready: {url}  (model '{model_name}', pp={config.scheduler.pp_size}, "
            f"tp={config.tp_size}, dp={config.dp_size}, {processes}up in {up_s:.1f} s)")


class StartupApp:
    """ASGI app: 503 "loading" until :meth:`set_app`, then the installed app."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None

    def set_app(self, app: ASGIApp) -> None:
        """Route every later request to ``app`` (the server app around the started engine)."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await send_loading(scope, send)
        # websocket / lifespan scopes: nothing to do while loading (uvicorn runs with lifespan off)


def loading_body(path: str) -> dict:
    """The body for ``path`` while the model loads (503, except 200 for ``/health/live``)."""
    if path == "/health/live":
        return {"status": "alive", "message": LOADING_MESSAGE}
    if path in ("/health", "/health/ready"):
        return {"status": "loading", "message": LOADING_MESSAGE}
    return APIError(LOADING_MESSAGE, status=503, type="service_unavailable",
                    code="model_loading").body()


async def send_loading(scope: Scope, send: Send) -> None:
    """Answer one HTTP request with 503 and :func:`loading_body` (the request body is not read)."""
    path = scope.get("path", "")
    body = JSONResponse(loading_body(path)).body   # the app's own JSON encoding
    await send({"type": "http.response.start", "status": 200 if path == "/health/live" else 503,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"5")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
