"""What the engine process runs: the asyncio engine, the launchers of the worker processes
(spawn and torchrun), the per-request streams and their outputs, the fault classification.

``AsyncEngine``, ``EngineDeadError`` and ``RequestRejected`` are importable from here; they load
on first use (PEP 562), so importing a submodule does not import the whole engine.
"""

from __future__ import annotations

_EXPORTS = ("AsyncEngine", "EngineDeadError", "RequestRejected")


def __getattr__(name: str):
    if name == "AsyncEngine":
        from runtime.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name in _EXPORTS:
        from runtime.engine import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'runtime.engine' has no attribute {name!r}")
