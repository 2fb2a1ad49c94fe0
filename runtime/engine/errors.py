"""The engine's errors: the engine is gone, or a request's input is bad."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine stopped (worker failure, timeout or shutdown); no request can be served."""


class RequestRejected(ValueError):
    """Bad request input; ``field`` names the offending field (the server answers HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)
