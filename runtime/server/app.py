"""The OpenAI-compatible FastAPI app around a started AsyncEngine.

Endpoints: GET /v1/models, GET /v1/models/{model}, POST /v1/completions, POST /v1/chat/completions,
POST /tokenize, POST /detokenize, GET /health, GET /health/live, GET /health/ready (Kubernetes probes,
see ``drain``), GET /metrics. ``create_app`` takes an engine that is already running (the CLI in
``runtime.serve`` starts it), so tests can build apps around any engine; all state (metrics registry
included) belongs to the app, and several apps can live in one process.

Bodies are parsed as JSON whatever the Content-Type (curl's ``-d`` sends a form type) and validated
with the pydantic schemas; every failure is an OpenAI-style error (see ``errors``).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from runtime.config import EngineConfig
from runtime.server.drain import DrainMiddleware, DrainState
from runtime.server.errors import APIError, install_error_handlers
from runtime.server.handlers import OpenAIHandlers
from runtime.server.metrics import ServerMetrics
from runtime.server.middleware import DEFAULT_MAX_BODY_BYTES, GuardMiddleware
from runtime.server.responses import ModelCard, ModelList
from runtime.server.schemas import ChatCompletionRequest, CompletionRequest
from runtime.server.tokenize_api import install_tokenize_routes

MAX_JSON_DEPTH_ERROR = "the JSON body is nested too deeply"
RESTARTING_MESSAGE = ("The engine failed and its workers are restarting; retry once /health "
                      "answers 200.")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text} does not fit a 64-bit float")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def check_utf8(payload: Any) -> None:
    """Every string of ``payload`` (object keys included) must be encodable as UTF-8.

    JSON lets a body carry a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a
    ``str`` that the tokenizer, the engine's message encoder and the response encoder all reject.
    Walks iteratively (the depth is bounded only by ``json.loads``).

    Raises:
        APIError: 400 naming the first offending field, e.g. ``messages[0].content``.
    """
    todo: list[tuple[str, Any]] = [("", payload)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"Invalid value for '{path or 'body'}': the string is not valid UTF-8 "
                               "(it holds a lone UTF-16 surrogate escape such as \\ud800).",
                               param=path or None, code="invalid_value") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(f"Invalid key in '{path or 'body'}': the name is not valid UTF-8.",
                                   param=path or None, code="invalid_value") from None
                todo.append((_path(path, k), v))
        elif isinstance(value, list):
            todo.extend((_path(path, i), v) for i, v in enumerate(value))


async def read_json(request: Request) -> Any:
    """The request body as a JSON object with UTF-8 strings and finite numbers only.

    Raises:
        APIError: 400, param None when the body is not JSON (NaN, Infinity and numbers beyond a
            64-bit float count as not JSON), or naming the field of a string that is not UTF-8.
    """
    raw = await request.body()
    if not raw.strip():
        raise APIError("The request body is empty; send a JSON object.", code="invalid_body")
    try:
        payload = json.loads(raw, parse_float=_finite_float, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(f"We could not parse the JSON body of your request: {MAX_JSON_DEPTH_ERROR}.",
                       code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"We could not parse the JSON body of your request: {exc}.",
                       code="invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError("The request body must be a JSON object.", code="invalid_body")
    check_utf8(payload)
    return payload


def create_app(engine: Any, config: EngineConfig, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, drain: DrainState | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """Build the server app for a started engine.

    Args:
        engine: a started ``runtime.engine.AsyncEngine`` (or anything with its interface).
        config: the engine's configuration (``max_model_len`` bounds prompts, in tokens).
        api_key: if set, ``/v1/...`` requests need ``Authorization: Bearer <api_key>``.
        max_body_bytes: largest accepted request body (bytes).
        drain: the server's drain state (``--shutdown-timeout``; a fresh one when None).
        reasoning_parser: split chat replies into ``reasoning_content`` and ``content``
            (:mod:`runtime.server.reasoning`), or None.
    """
    app = FastAPI(title="ppstate", summary="OpenAI-compatible server of a pipeline-parallel engine",
                  version="0.1.0")
    metrics = ServerMetrics(engine)
    handlers = OpenAIHandlers(engine, config, metrics, reasoning_parser)
    created = int(time.time())
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.handlers = handlers
    app.state.drain = drain = drain or DrainState()
    install_error_handlers(app)
    app.add_middleware(DrainMiddleware, state=drain)   # inside the guard: its 503s are counted
    app.add_middleware(GuardMiddleware, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)

    def require_engine() -> None:
        if getattr(engine, "restarting", False):  # --restart-workers (runtime/engine/supervisor.py)
            raise APIError(RESTARTING_MESSAGE, status=503, type="service_unavailable",
                           code="engine_restarting")
        if not engine.is_alive:
            raise APIError("The engine is not running.", status=503, type="service_unavailable",
                           code="engine_dead")

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while every rank of the engine is alive, 503 ``restarting`` while fresh workers
        load after a failure (``--restart-workers``), else 503 ``engine_dead``."""
        if getattr(engine, "restarting", False):
            return JSONResponse({"status": "restarting", "message": RESTARTING_MESSAGE},
                                status_code=503, headers={"Retry-After": "5"})
        detail = getattr(engine, "health_detail", None)  # runtime.dp.replicas.ReplicatedEngine
        if detail is not None and not engine.is_alive:
            raise APIError(f"The engine is not running: {engine.error}", status=503,
                           type="service_unavailable", code="engine_dead")
        require_engine()
        return JSONResponse({"status": "ok"} if detail is None
                            else {"status": "ok", "replicas": detail()})

    @app.get("/health/live")
    async def live() -> JSONResponse:
        """Liveness: 200 while the process serves and its engine is alive or restarting (also
        while draining); 503 ``engine_dead`` once the engine failed for good."""
        if not engine.is_alive and not getattr(engine, "restarting", False):
            return JSONResponse({"status": "engine_dead",
                                 "message": str(getattr(engine, "error", None))},
                                status_code=503)
        return JSONResponse({"status": "alive"})

    @app.get("/health/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 when new requests are served; 503 while restarting, draining (answered
        by the drain middleware) or after an engine failure."""
        require_engine()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        """Prometheus text exposition of the server and engine metrics."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> ModelCard:
        return ModelCard(id=handlers.model_name, created=created, root=config.model,
                         max_model_len=config.scheduler.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        """The served model (it also answers to the name ``default``)."""
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}", response_model=ModelCard)
    async def get_model(model: str) -> ModelCard:
        """One model by its served name or ``default``."""
        if model not in ("default", handlers.model_name):
            raise APIError(f"The model '{model}' does not exist.", status=404, type="invalid_request_error",
                           param="model", code="model_not_found")
        return card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """OpenAI text completion, streamed (SSE) or not."""
        body = CompletionRequest.model_validate(await read_json(request))
        require_engine()
        return await handlers.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completion, streamed (SSE) or not."""
        body = ChatCompletionRequest.model_validate(await read_json(request))
        require_engine()
        return await handlers.chat(body, request)

    install_tokenize_routes(app, handlers, read_json, require_engine)
    return app
