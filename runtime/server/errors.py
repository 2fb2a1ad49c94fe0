"""OpenAI-style error bodies and the exception handlers that produce them.

Every error the server returns has the body ``{"error": {"message", "type", "param", "code"}}``.
Invalid requests are HTTP 400 (not FastAPI's 422: OpenAI clients expect 400) and ``param`` names the
offending field, e.g. ``max_tokens`` or ``messages[0].role``; ``param`` is null when no single field is
to blame (unparsable JSON, oversized body).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("runtime.server")

# Pydantic puts the union member or validator kind into ``loc`` ("str", "list[int]",
# "function-after[...]"); these are not field names and are left out of ``param``.
_FIELD_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "union"}


class APIError(Exception):
    """An error to be returned to the client as an OpenAI-style JSON body.

    Attributes:
        status: HTTP status code.
        message: human-readable explanation.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the offending request field, or None.
        code: machine-readable code (``model_not_found``, ``context_length_exceeded``, ...) or None.
    """

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """This error as a JSONResponse."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    def encoded(self) -> bytes:
        """The body's bytes exactly as :meth:`response` (and so every FastAPI error handler)
        writes them (compact UTF-8 JSON), for the ASGI layers that answer before the app."""
        return self.response().body


def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """Turn a pydantic error location into an OpenAI ``param``.

    ``("body", "messages", 0, "role")`` -> ``"messages[0].role"``; ``("body",)`` -> None.
    A leading ``"body"`` is dropped; union tags like ``"list[int]"`` are skipped.
    """
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            if not out:
                return None  # a JSON position inside an unparsable body, not a field
            out += f"[{part}]"
        elif isinstance(part, str) and _FIELD_RE.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out or None


def error_from_validation(errors: list[dict[str, Any]], prefix: tuple[Any, ...] = ()) -> APIError:
    """Build one 400 APIError from pydantic's error list (the first error wins)."""
    if not errors:
        return APIError("Invalid request.")
    err = errors[0]
    kind = err.get("type", "")
    param = param_from_loc(prefix + tuple(err.get("loc", ())))
    msg = str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError("We could not parse the JSON body of your request: "
                        f"{err.get('ctx', {}).get('error', msg)}.", code="invalid_json")
    if param is None:
        if kind == "missing":
            return APIError("The request body is missing; send a JSON object.", code="invalid_body")
        return APIError(f"The request body must be a JSON object ({msg}).", code="invalid_body")
    if kind == "missing":
        return APIError(f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_parameter")
    return APIError(f"Invalid value for '{param}': {msg}", param=param, code="invalid_value")


_STATUS_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                 413: "invalid_request_error", 503: "service_unavailable"}


def install_error_handlers(app: FastAPI) -> None:
    """Register handlers so that every failure leaves the server as an OpenAI-style JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_from_validation(list(exc.errors())).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return error_from_validation(exc.errors(include_url=False)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), status=exc.status_code,
                       type=_STATUS_TYPES.get(exc.status_code, "invalid_request_error"))
        return err.response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return APIError(f"Internal server error: {type(exc).__name__}", status=500,
                        type="internal_server_error").response()
