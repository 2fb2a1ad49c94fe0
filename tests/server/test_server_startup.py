"""``runtime.serve.serve`` answers on its port while the model loads (issue #12).

The engine start is replaced by a coroutine that waits for the test's go-ahead, so "still loading"
is a state the test controls (no timing). The server, its socket and HTTP are real.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from runtime.serve import bind_socket, parse_cli, serve, url_of
from runtime.server.startup import LOADING_MESSAGE
from test_server_api import REPLY, FakeEngine


class StartedFake(FakeEngine):
    """FakeEngine plus the lifecycle calls ``serve`` makes."""

    def __init__(self) -> None:
        super().__init__()
        self.shutdowns = 0

    async def abort_all(self, message: str) -> None:
        for rid in list(self.live):
            await self.abort(rid)

    async def shutdown(self) -> None:
        self.shutdowns += 1
        self.is_alive = False


async def get_when_listening(c: httpx.AsyncClient, path: str) -> httpx.Response:
    """GET ``path`` once uvicorn accepts connections (the socket is bound before serve starts,
    so a connection is queued, never refused; retried only on uvicorn's own startup)."""
    for _ in range(1000):
        try:
            return await c.get(path)
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            await asyncio.sleep(0.01)
    raise AssertionError("server never answered")


def test_health_is_503_loading_then_200_then_engine_death_exits_1():
    async def scenario():
        sock = bind_socket("127.0.0.1", 0)
        args, config = parse_cli(["--port", "0"])
        release, engine, started = asyncio.Event(), StartedFake(), []

        async def start(cfg):
            started.append(cfg)
            await release.wait()
            return engine

        task = asyncio.create_task(serve(config, args, sock, start_engine=start))
        async with httpx.AsyncClient(base_url=url_of(sock, "127.0.0.1"), timeout=30) as c:
            r = await get_when_listening(c, "/health")
            assert (r.status_code, r.json()) == (503, {"status": "loading", "message": LOADING_MESSAGE})
            r = await c.get("/health/ready")   # Kubernetes: not ready, but alive while loading
            assert (r.status_code, r.json()["status"]) == (503, "loading")
            r = await c.get("/health/live")
            assert (r.status_code, r.json()["status"]) == (200, "alive")
            r = await c.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
            assert started == [config] and not task.done()
            release.set()
            while (r := await c.get("/health")).status_code == 503:
                assert r.json()["status"] == "loading"
                await asyncio.sleep(0.01)
            assert r.json() == {"status": "ok"}
            r = await c.post("/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY[:3]
            engine.is_alive = False                      # the engine died
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = await c.get("/health/live")
            assert (r.status_code, r.json()["status"]) == (503, "engine_dead")
            assert (await c.get("/health/ready")).status_code == 503
        code = await task
        sock.close()
        return code, engine.shutdowns

    assert asyncio.run(scenario()) == (1, 1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_while_loading_cancels_the_start_and_exits_130(sig):
    async def scenario():
        sock = bind_socket("127.0.0.1", 0)
        args, config = parse_cli(["--port", "0"])
        cancelled = asyncio.Event()

        async def start(cfg):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        task = asyncio.create_task(serve(config, args, sock, start_engine=start))
        async with httpx.AsyncClient(base_url=url_of(sock, "127.0.0.1"), timeout=30) as c:
            assert (await get_when_listening(c, "/health")).status_code == 503
        os.kill(os.getpid(), sig)
        code = await task
        sock.close()
        return code, cancelled.is_set()

    assert asyncio.run(scenario()) == (130, True)
