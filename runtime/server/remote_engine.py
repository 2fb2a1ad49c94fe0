"""The engine as an API-server process sees it with ``--api-server-count N``: a proxy over ZMQ.

:class:`RemoteEngine` has the interface the app uses of :class:`~runtime.engine.AsyncEngine`
(``add_request``, ``abort``, ``abort_all``, ``stats``, ``is_alive``, ``error``, ``model_name``,
``tokenizer``, ``shutdown``) and forwards to the engine-core process
(:mod:`runtime.server.engine_core`). It tokenizes and checks each request here, in the API
server, with the same admission checks the engine runs (a bad request is a 400 before anything is
sent); the core's increments arrive in batches and go to per-request streams that merge unread
increments, as the engine's own streams do. ``stats()`` answers from the last snapshot the core
sent (at most ``STATS_INTERVAL_S`` old); when the core is silent for ``CORE_SILENCE_S`` or reports
its death, the engine counts as dead and every open stream ends with the engine error.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from runtime.config import EngineConfig
from runtime.engine.admission import admission_checks, check_kv_fit, check_prompt
from runtime.engine.errors import EngineDeadError, RequestRejected
from runtime.engine.faults import ENGINE, REQUEST, SHUTDOWN
from runtime.engine.outputs import RequestOutput
from runtime.engine.request_stream import RequestStream, merge_into
from runtime.sampling_params import SamplingParams
from runtime.server.core_messages import CORE_SILENCE_S, decode, encode, unpack_output


class RemoteStream:
    """One request's increments on the API-server side (at most one pending, merged)."""

    __slots__ = ("req_id", "num_prompt_tokens", "finished", "_pending", "_waiter")

    def __init__(self, req_id: str, num_prompt_tokens: int) -> None:
        self.req_id, self.num_prompt_tokens = req_id, num_prompt_tokens
        self.finished = False
        self._pending: RequestOutput | None = None
        self._waiter: asyncio.Future | None = None

    def put(self, out: RequestOutput) -> None:
        """Queue an increment (merged into an unread one); nothing after the final one."""
        if self.finished:
            return
        self.finished = out.finished
        if self._pending is None:
            self._pending = out
        else:
            merge_into(self._pending, out)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def end(self, reason: str, error: str | None = None, kind: str | None = None) -> None:
        """Queue a final token-less increment (abort, failure)."""
        self.put(RequestOutput(self.req_id, [], "", True, reason, self.num_prompt_tokens, 0,
                               None, error, kind))

    #: the engine stream's own loop (one pending increment, one waiter; ``on_close(req_id)`` when
    #: the reader leaves before the final increment): the same slots, so the same code
    iterate = RequestStream.iterate


class RemoteEngine:
    """Proxy of the engine core for API server ``index`` (create with :meth:`start`)."""

    def __init__(self, config: EngineConfig, index: int, ctx: zmq.asyncio.Context,
                 push: zmq.asyncio.Socket, pull: zmq.asyncio.Socket, info: dict) -> None:
        from runtime.engine.plan import plan_pipeline
        from runtime.engine.trace import scheduler_config
        from runtime.model.chat_templates import load_serving_tokenizer
        self.config, self.index = config, index
        self._ctx, self._push, self._pull = ctx, push, pull
        self.model_name: str = info["model_name"]
        # the engine core's template (--chat-template): the API servers render the chat prompts
        self.tokenizer = load_serving_tokenizer(plan_pipeline(config).model_path,
                                                config.chat_template)
        self.core_pid: int = info["pid"]
        self._sched = scheduler_config(config, info["num_kv_blocks"])   # the core's, for check_kv_fit
        self._streams: dict[str, RemoteStream] = {}
        self._stats: dict = {}
        self._alive, self._error, self._closed = True, None, False
        self._heard = time.monotonic()
        self._recv = asyncio.create_task(self._recv_loop())
        self._watch = asyncio.create_task(self._watch_loop())

    @classmethod
    async def start(cls, config: EngineConfig, index: int, in_addr: str, out_addr: str) -> "RemoteEngine":
        """Connect to the core and wait until its engine is up.

        Raises:
            EngineDeadError: the core reported that the engine failed to start.
        """
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(out_addr)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(in_addr)
        try:
            while True:
                msg = decode(await pull.recv())
                if msg[0] == "ready":
                    return cls(config, index, ctx, push, pull, msg[1])
                if msg[0] == "dead":
                    raise EngineDeadError(msg[1])
        except BaseException:
            pull.close(linger=0)
            push.close(linger=0)
            ctx.term()
            raise

    # ---- the AsyncEngine interface ------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._alive and not self._closed

    @property
    def error(self) -> str | None:
        return self._error

    def stats(self) -> dict:
        """The core's last ``stats()`` snapshot.

        Raises:
            EngineDeadError: none arrived yet.
        """
        if not self._stats:
            raise EngineDeadError("no statistics from the engine core yet")
        return self._stats

    def add_request(self, req_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, fork_of: str | None = None) -> AsyncIterator[RequestOutput]:
        """Check the request here and send it to the core (raises as ``AsyncEngine.add_request``)."""
        if not self.is_alive:
            raise EngineDeadError(self._error or "engine is shut down")
        req_id = req_id or uuid.uuid4().hex
        if req_id in self._streams:
            raise RequestRejected("request_id", f"request id {req_id!r} is already in use by a "
                                  "live request")
        check_prompt(prompt_token_ids, self.tokenizer.vocab_size, self.config.scheduler)
        check_kv_fit(len(prompt_token_ids), params.max_tokens, self._sched)
        prompt = [int(t) for t in prompt_token_ids]
        admission_checks(req_id, tuple(prompt), params, self.config.scheduler.max_model_len)
        stream = RemoteStream(req_id, len(prompt))
        self._streams[req_id] = stream
        self._push.send(encode(["add", self.index, req_id, prompt, params.model_dump(), fork_of]))
        return stream.iterate(self.abort)

    async def abort(self, req_id: str) -> None:
        stream = self._streams.pop(req_id, None)
        if stream is not None:
            stream.end("abort")
            await self._push.send(encode(["abort", req_id]))

    async def abort_all(self, message: str) -> None:
        """End every request of this API server with the shutdown error (and abort it in the core)."""
        for req_id, stream in list(self._streams.items()):
            self._streams.pop(req_id, None)
            stream.end("abort", message, SHUTDOWN)
            await self._push.send(encode(["abort", req_id]))

    async def shutdown(self) -> None:
        """Abort this API server's requests, close the sockets (the core stops on its own signal)."""
        if self._closed:
            return
        for req_id in list(self._streams):
            await self.abort(req_id)
        self._closed = True
        for t in (self._recv, self._watch):
            t.cancel()
        await asyncio.gather(self._recv, self._watch, return_exceptions=True)
        self._push.close(linger=200)
        self._pull.close(linger=0)
        self._ctx.term()

    # ---- messages from the core -----------------------------------------------------------------
    def _die(self, error: str) -> None:
        if self._alive:
            self._alive, self._error = False, error
            for stream in self._streams.values():
                stream.end("abort", error, ENGINE)
            self._streams.clear()

    async def _recv_loop(self) -> None:
        streams = self._streams
        while True:
            msg = decode(await self._pull.recv())
            self._heard = time.monotonic()
            kind = msg[0]
            if kind == "outs":
                for row in msg[1]:
                    stream = streams.get(row[0])
                    if stream is not None:
                        out = unpack_output(row)
                        stream.put(out)
                        if out.finished:
                            streams.pop(row[0], None)
            elif kind == "stats":
                self._stats = msg[1]
                if not msg[2]:
                    self._die(msg[3] or "the engine stopped")
            elif kind == "reject":
                stream = streams.pop(msg[1], None)
                if stream is not None:
                    stream.end("abort", msg[3], ENGINE if msg[4] == "dead" else REQUEST)
            elif kind == "dead":
                self._die(msg[1])

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if time.monotonic() - self._heard > CORE_SILENCE_S:
                self._die(f"the engine core sent nothing for {CORE_SILENCE_S:.0f} s")
