"""Pure-ASGI guard in front of the app: API key, body size limit, error counting.

* API key: with a key configured, every ``/v1/...`` request needs ``Authorization: Bearer KEY``
  (compared in constant time), else HTTP 401. ``/health`` and ``/metrics`` stay open.
* Body limit: a request body over ``max_body_bytes`` (bytes; checked from Content-Length and while
  reading) is answered HTTP 413 (RFC 9110 section 15.5.14, "Content Too Large") without being
  buffered further. The accepted body is replayed to the
  app, and later ``receive`` calls pass through, so disconnects are still seen.
* Body headers: a ``Content-Length`` that is not a byte count is HTTP 400 naming
  ``content-length``; a ``Content-Encoding`` other than ``identity`` is HTTP 415 naming
  ``content-encoding`` (compressed bodies are not decoded).
* Every response with status >= 400 increments ``ppstate_request_errors_total{status}``.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.server.errors import APIError
from runtime.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 1 << 20


async def _send_error(send: Send, err: APIError) -> None:
    body = err.encoded()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _check_body_headers(headers: dict[bytes, bytes]) -> APIError | None:
    """The request's body headers are usable: ``Content-Length`` a decimal byte count (400
    naming ``content-length`` otherwise), no ``Content-Encoding`` but ``identity`` (bodies are
    never decompressed: 415 naming ``content-encoding``, RFC 9110 section 15.5.16)."""
    length = headers.get(b"content-length")
    if length is not None and not length.strip().isdigit():
        return APIError(f"Invalid header 'Content-Length: {length.decode('latin-1')[:40]}': it must "
                        "be the body's size in bytes.", param="content-length", code="invalid_header")
    encoding = headers.get(b"content-encoding", b"").strip().lower()
    if encoding not in (b"", b"identity"):
        return APIError(f"Unsupported 'Content-Encoding: {encoding.decode('latin-1')[:40]}': send "
                        "the JSON body uncompressed.", status=415, param="content-encoding",
                        code="unsupported_content_encoding")
    return None


#: paths outside /v1 that also need the API key
KEYED_PATHS = ("/tokenize", "/detokenize")


class GuardMiddleware:
    """API key check, body size limit and error counting for one app."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.errors.labels(str(message["status"])).inc()
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and (scope.get("path", "").startswith("/v1")
                                         or scope.get("path") in KEYED_PATHS):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                msg = ("Incorrect API key provided." if auth else
                       "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
                await _send_error(counting_send, APIError(msg, status=401, type="invalid_request_error",
                                                          code="invalid_api_key"))
                return
        too_large = APIError(f"The request body exceeds the limit of {self.max_body_bytes} bytes.",
                             status=413, code="request_too_large")
        bad_header = _check_body_headers(headers)
        if bad_header is not None:
            await _send_error(counting_send, bad_header)
            return
        length = headers.get(b"content-length")
        if length is not None and int(length) > self.max_body_bytes:
            await _send_error(counting_send, too_large)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(counting_send, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay_receive() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay_receive, counting_send)
