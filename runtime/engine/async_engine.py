"""AsyncEngine: the asyncio front of a pipeline of worker processes (one per PP rank).

The engine owns the ppstate :class:`~ppstate.scheduler.Scheduler`. Its loop issues steps while the
scheduler allows (pp_size + 1 in flight in overlapped mode, 1 in sync mode), sends each
:class:`SchedulerOutput` to every rank, and turns the last rank's :class:`StepResult` into
per-request stream increments. Which failures end one request and which stop the engine is
decided in :mod:`runtime.engine.faults`: a failure inside a request's own work (building its sampling
parameters or stop-string matcher, encoding it, detokenizing its tokens, its logprobs) fails that
request only; a worker error, a dead worker or a step past ``step_timeout_s`` fails every in-flight
request with that error and stops all processes (never a hang).

The engine owns two helpers: :class:`~runtime.engine.result_delivery.ResultDelivery` (a step's
result -> the streams) and :class:`~runtime.engine.liveness.Liveness` (when the engine must die).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from ppstate.events import NULL_SINK, JsonlSink
from ppstate.scheduler import RequestSpec, Scheduler
from ppstate.trace.run import ENGINE_FILE
from runtime.config import EngineConfig
from runtime.engine.admission import admission_checks, check_kv_fit, check_prompt
from runtime.engine.counters import EngineCounters
from runtime.engine.errors import EngineDeadError, RequestRejected
from runtime.engine.faults import ENGINE, SHUTDOWN, request_scope
from runtime.engine.heap import freeze_startup_heap
from runtime.engine.launcher import WorkerPool
from runtime.engine.liveness import Liveness
from runtime.engine.outputs import RequestOutput
from runtime.engine.plan import plan_pipeline
from runtime.engine.request_stream import RequestStream
from runtime.engine.result_delivery import ResultDelivery
from runtime.engine.trace import scheduler_config, start_trace_run, write_trace_header
from runtime.model.detokenizer import IncrementalDetokenizer
from runtime.messages import ControlMsg
from runtime.model.chat_templates import load_serving_tokenizer
from runtime.model.tokenizer import Tokenizer
from runtime.sampling_params import SamplingParams
from runtime.engine.stall import StallDetector
from runtime.worker.kv_capacity import capacity_summary


HEALTH_CHECK_S = 1.0  # seconds between two checks of the ranks' liveness and progress
DRAIN_MAX = 4096      # messages handled at most by one _drain before the health check runs
DEATH_GRACE_S = 1.0   # seconds the ranks get to exit by themselves after an engine failure
FINISH_S = 2.0        # seconds a shutdown with no live request waits for the steps in flight
FINISH_POLL_S = 0.002


class AsyncEngine:
    """Serve requests over a pipeline of ``config.scheduler.pp_size`` worker processes.

    Create with ``await AsyncEngine.start(config)``; stop with ``await engine.shutdown()``.
    """

    def __init__(self, config: EngineConfig, pool: WorkerPool, tokenizer: Tokenizer) -> None:
        self.config, self.pool, self.tokenizer = config, pool, tokenizer
        self.model_name = pool.plan.served_name
        self.sink = (JsonlSink(Path(config.trace_dir) / ENGINE_FILE, config.trace_prompts)
                     if config.trace_dir else NULL_SINK)
        self.sched = Scheduler(scheduler_config(config, pool.num_kv_blocks), sink=self.sink)
        self._streams: dict[str, RequestStream] = {}
        self._step_rows: dict[int, tuple[str, ...]] = {}
        self._wake = asyncio.Event()
        self._error: str | None = None
        self._closed = False
        self._tasks: list[asyncio.Task] = []
        self.counters = EngineCounters(config.world_size)   # per rank process (pp x tp)
        self.stalls = StallDetector(config.world_size, config.stall_timeout_s)  # from heartbeats
        self.liveness = Liveness(config, pool, self.stalls, self.sched, self._die)
        self.delivery = ResultDelivery(self.sched, self._streams, self._step_rows, self.counters,
                                       self._wake, self._issue_steps)

    # ---- lifecycle ---------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> "AsyncEngine":
        """Spawn the workers, wait until every rank loaded its layers, start the step loop.

        Raises:
            EngineDeadError: a worker failed while starting (message carries its error).
        """
        if config.trace_dir:  # a fresh run directory; workers write their files into it
            config = config.model_copy(update={"trace_dir": str(start_trace_run(config))})
        plan = plan_pipeline(config)
        pool = WorkerPool(config, plan)
        # --chat-template FILE|hermes (docs/structured.md)
        tokenizer = load_serving_tokenizer(plan.model_path, config.chat_template)
        try:
            await pool.start()
        except BaseException as exc:  # cancellation too: never leave worker processes behind
            await pool.shutdown()
            if isinstance(exc, Exception):
                raise EngineDeadError(f"engine failed to start: {exc}") from exc
            raise
        engine = cls(config, pool, tokenizer)
        freeze_startup_heap()  # before any request: a full collection walks only what follows
        sc = engine.sched.config
        if config.trace_dir:  # the header again, now with the KV block count the ranks reported
            write_trace_header(Path(config.trace_dir), config, sc)
        print(capacity_summary(sc.num_kv_blocks, sc.block_size, sc.max_model_len), file=sys.stderr,
              flush=True)
        engine._tasks = [asyncio.create_task(engine._step_loop()),
                         asyncio.create_task(engine._result_loop())]
        return engine

    async def shutdown(self) -> None:
        """Abort every live request, stop the loops and the worker processes. With no live
        request (the work is done) the steps in flight are finished first
        (:meth:`_finish_in_flight`)."""
        if not self._closed:
            await self._finish_in_flight()
            self._closed = True
            self._fail_all(error=None)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.shutdown()
        self.sink.close()

    async def _finish_in_flight(self, timeout_s: float = FINISH_S) -> None:
        """Wait, at most ``timeout_s``, until no step is in flight, while the engine lives and
        no request is live. The last step of a finished run often only delivers freed slots to
        the ranks, which run it; without this its result was never read and a finished run's
        trace ended with that step in flight. A shutdown while requests are live stops at once
        (they end with ``abort``); a pipeline that does not answer within ``timeout_s`` too."""
        deadline = time.monotonic() + timeout_s
        while (self.is_alive and not self._streams and not self.sched.num_running
               and not self.sched.num_waiting and time.monotonic() < deadline):
            self._issue_steps()   # slots freed by an abort the step loop has not delivered yet
            if not self.sched.in_flight:
                return
            await asyncio.sleep(FINISH_POLL_S)   # the result loop reads the results meanwhile

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._error is None

    @property
    def error(self) -> str | None:
        """Why the engine died (None while alive)."""
        return self._error

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, fork_of: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of increments.

        ``fork_of``: id of a request with the same prompt added before (the first of ``n``
        samples); this one then shares its prompt's KV blocks (``RequestSpec.fork_of``).
        A request asking for ``prompt_logprobs`` takes no prefix-cache hit (every prompt
        position must be computed).

        Raises:
            EngineDeadError: the engine is not running.
            RequestRejected: empty prompt, token id outside the vocabulary, prompt not shorter
                than ``max_model_len``, id of a live request (field ``request_id``; the id of a
                finished or aborted request may be used again, as in vLLM).
            RequestFailure: the request's own admission work failed (stages ``sampling_params``,
                ``encode``, ``stop_strings`` of :mod:`runtime.engine.faults`); nothing was queued.
        """
        if not self.is_alive:
            raise EngineDeadError(self._error or "engine is shut down")
        req_id = req_id or uuid.uuid4().hex
        if req_id in self._streams or self.sched.is_live(req_id):
            raise RequestRejected("request_id", f"request id {req_id!r} is already in use by a "
                                  "live request")
        check_prompt(prompt_token_ids, self.tokenizer.vocab_size, self.config.scheduler)
        check_kv_fit(len(prompt_token_ids), params.max_tokens, self.sched.config)
        prompt = tuple(int(t) for t in prompt_token_ids)
        sampling = admission_checks(req_id, prompt, params, self.config.scheduler.max_model_len)
        with request_scope(req_id, "stop_strings"):
            detok = IncrementalDetokenizer(self.tokenizer, prompt, stop=params.stop)
        eos = self.tokenizer.eos_token_id
        spec = RequestSpec(
            req_id=req_id, prompt_token_ids=prompt, max_tokens=params.max_tokens,
            eos_token_ids=frozenset() if eos is None else frozenset({eos}),
            stop_token_ids=frozenset(params.stop_token_ids), ignore_eos=params.ignore_eos,
            sampling=sampling, fork_of=fork_of, prefix_cache=params.prompt_logprobs is None)
        self.sched.add_request(spec)
        stream = RequestStream(req_id, params, len(prompt), detok)
        self._streams[req_id] = stream
        self._wake.set()
        return stream.iterate(self.abort)

    def warm_grammar(self) -> None:
        """Ask the last rank to load the grammar engine now (structured outputs, in the
        background); the server calls this when its first constrained request arrives."""
        if self.is_alive:
            for rank in range(self.config.result_rank, self.config.world_size):  # every TP rank
                self.pool.send_control(rank, ControlMsg(kind="warm_grammar"))     # of the last stage

    async def abort(self, req_id: str) -> None:
        """Abort ``req_id`` (idempotent). Its stream ends with finish_reason ``abort`` and its slot
        is freed in the next step."""
        stream = self._streams.pop(req_id, None)
        if self.sched.abort(req_id):
            self._wake.set()
        if stream is not None:
            stream.finish("abort")

    async def abort_all(self, message: str) -> None:
        """Abort every live request; each stream ends with finish_reason ``abort``, ``error``
        set to ``message`` and ``error_kind`` ``"shutdown"`` (used when the server is asked to stop
        while streams are open)."""
        for req_id, stream in list(self._streams.items()):
            self._streams.pop(req_id, None)
            self.sched.abort(req_id)
            stream.finish("abort", error=message, error_kind=SHUTDOWN)
        self._wake.set()

    # ---- loops -------------------------------------------------------------------------------
    async def _step_loop(self) -> None:
        try:
            while self.is_alive:
                self._issue_steps()
                self._mark_idle()
                self._wake.clear()
                await self._wake.wait()
        except Exception as exc:  # noqa: BLE001 - any failure must fail the requests, not hang
            self._die(f"engine step loop failed: {exc!r}")

    def _issue_steps(self) -> None:
        """Schedule and send steps while the scheduler allows (pp_size + 1 in flight when
        overlapped, 1 in sync mode)."""
        while self.is_alive and (out := self.sched.schedule()) is not None:
            self._step_rows[out.step] = out.req_ids
            self.delivery.note_admitted(out.new_requests)
            self.counters.step_issued()
            self.pool.send_step(out)

    async def _result_loop(self) -> None:
        try:
            checked = time.monotonic()
            while self.is_alive:
                msg = await self.pool.recv(timeout_s=HEALTH_CHECK_S)
                if msg is not None:
                    self._handle(msg)
                    # A queued message is awaited without yielding, and a result issues the next
                    # step itself: yield once per message so that the streams woken by this result
                    # (clients, the HTTP server) run before the next result is handled.
                    await asyncio.sleep(0)
                if time.monotonic() - checked >= HEALTH_CHECK_S:  # even while messages flow
                    await self._drain()
                    checked = time.monotonic()
                    self._check_health()
        except Exception as exc:  # noqa: BLE001
            self._die(f"engine result loop failed: {exc!r}")

    async def _drain(self) -> None:
        """Handle every message already queued. A rank's silence is judged on what it sent, not
        on when this loop got round to reading it: after the engine's own loop was held up (a
        long synchronous stretch, CPU starvation), the ranks' heartbeats wait in the queue and
        must not read as silence."""
        for _ in range(DRAIN_MAX):  # bounded: results keep arriving while steps are issued
            if not self.is_alive or (msg := await self.pool.recv(timeout_s=0)) is None:
                return
            self._handle(msg)
            await asyncio.sleep(0)

    def _handle(self, msg) -> None:
        kind = msg.kind
        if kind == "error":
            self.liveness.on_rank_error(f"rank {msg.rank} failed at step {msg.step}: "
                                        f"{msg.error_type}: {msg.message}")
        elif kind == "result":
            self.counters.busy_s[msg.rank] += msg.busy_s
            self.counters.note_dropped(msg.rank, msg.dropped_rows)
            if msg.rank == self.config.result_rank:   # TP rank 0 of the last stage
                self._on_result(self.pool.to_step_result(msg))
        elif kind == "heartbeat":
            self.stalls.observe(msg)

    def _on_result(self, result) -> None:
        """Deliver one step's result (:meth:`ResultDelivery.on_result`)."""
        self.liveness.progressed()
        self.delivery.on_result(result)

    def _check_health(self) -> None:
        """Fail the engine when the pipeline is unhealthy (:meth:`Liveness.check`)."""
        if self.is_alive:
            self.liveness.check()

    def _die(self, error: str) -> None:
        if self._error is None and not self._closed:
            self._error = error
            self._fail_all(error=error)
            self._wake.set()
            # the surviving ranks are likely blocked in a collective with the failed one and
            # cannot read a shutdown message: a short grace, then SIGTERM / SIGKILL
            asyncio.get_running_loop().create_task(self.pool.shutdown(grace_s=DEATH_GRACE_S))

    def _fail_all(self, error: str | None) -> None:
        """End every live stream with finish_reason ``abort`` (and ``error`` when the engine died)."""
        for stream in list(self._streams.values()):
            stream.finish("abort", error=error, error_kind=None if error is None else ENGINE)
        self._streams.clear()

    def _mark_idle(self) -> None:
        if not self.sched.in_flight:
            self.counters.pipeline_idle()

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for /metrics: requests, steps, tokens, per-rank busy seconds, bubble fraction
        (:class:`~runtime.engine.counters.EngineCounters`), KV cache and speculative decoding.
        ``rank_busy_seconds`` has one entry per rank process (global rank ``pp_rank * tp +
        tp_rank``) and the bubble fraction counts all of them; ``pp_size`` is the stages."""
        return {"num_running": self.sched.num_running, "num_waiting": self.sched.num_waiting,
                **self.counters.snapshot(), **self.sched.kv_stats(), **self.sched.spec_stats(),
                "pp_size": self.config.scheduler.pp_size, "tp_size": self.config.tp_size}
