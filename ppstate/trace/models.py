"""Typed events of a trace (format version :data:`TRACE_FORMAT_VERSION`, ``docs/trace_format.md``).

Emit sites write flat dicts (cheap); these pydantic models are what a reader gets back:
:func:`parse_event` picks the model by ``kind``. Every model has ``kind``, ``step`` (the step the
event belongs to; for scheduler inputs the step the core was about to issue when it observed the
input) and ``rank`` (``None``: the engine / scheduler process).

Scheduler inputs (what replay feeds): ``arrival``, ``abort``, ``stop``, ``result``.
Scheduler decisions (what replay re-derives): ``lifecycle``, ``schedule``, ``tokens``.
Rank decisions: ``rank.step``, ``pp.consume``, ``pp.free``, ``pp.enqueue``, ``broadcast.posted``,
``broadcast.skipped``, ``sampled``, ``mirror.check``. Timing only: ``timing``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

TRACE_FORMAT_VERSION = 1


class _Ev(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = -1
    rank: int | None = None


# ---------------------------------------------------------------- scheduler inputs
class ArrivalEvent(_Ev):
    """A request accepted by the scheduler (prompt ids only with ``--trace-prompts``)."""
    kind: Literal["arrival"] = "arrival"
    req_id: str
    prompt_len: int                     # tokens
    max_tokens: int                     # as submitted (the scheduler caps it)
    eos_token_ids: list[int] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    sampling: dict[str, Any] = Field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    prefix_hashes: list[int] | None = None  # chained hashes of full prompt blocks (no prompt ids)
    fork_of: str | None = None          # the request this one is forked from (n > 1)
    prefix_cache: bool = True           # False: no prefix-cache hits (prompt logprobs)


class AbortEvent(_Ev):
    """A client abort as the scheduler saw it (also for ids already finished)."""
    kind: Literal["abort"] = "abort"
    req_id: str


class StopEvent(_Ev):
    """An external stop (stop string found by the engine's detokenizer)."""
    kind: Literal["stop"] = "stop"
    req_id: str


class ResultEvent(_Ev):
    """The last rank's output of step ``of_step`` reaching the scheduler."""
    kind: Literal["result"] = "result"
    of_step: int
    token_ids: list[list[int]]          # [num_rows, width]
    num_sampled: list[int]              # [num_rows]
    num_rejected: list[int]             # [num_rows]


# ---------------------------------------------------------------- scheduler decisions
class LifecycleEvent(_Ev):
    """A lifecycle edge fired (``state`` is the state after it)."""
    kind: Literal["lifecycle"] = "lifecycle"
    req_id: str
    trigger: str
    state: str


class ScheduleEvent(_Ev):
    """One issued step: every field of its SchedulerOutput (:mod:`ppstate.codec`)."""
    kind: Literal["schedule"] = "schedule"
    output: dict[str, Any]


class TokenUpdateModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    req_id: str
    token_ids: list[int]
    finish_reason: str | None = None


class TokensEvent(_Ev):
    """What the scheduler delivered to clients from the result of ``of_step``."""
    kind: Literal["tokens"] = "tokens"
    of_step: int
    discarded: int = 0                  # rows whose request had left the slot (dropped)
    updates: list[TokenUpdateModel]


# ---------------------------------------------------------------- rank decisions
class RankStepEvent(_Ev):
    """Rank ``rank`` starts running step ``step`` (events until the next one belong to it)."""
    kind: Literal["rank.step"] = "rank.step"
    num_rows: int


class PPConsumeEvent(_Ev):
    """The deferred entry of step ``step`` consumed (``-1``: row skipped)."""
    kind: Literal["pp.consume"] = "pp.consume"
    idx_mapping: list[int]              # [num_rows]
    dropped: int = 0                    # rows needing a sample dropped as stale (generation)


class PPFreeEvent(_Ev):
    """A slot freed in the PPHandler; ``generation`` is the new value."""
    kind: Literal["pp.free"] = "pp.free"
    slot: int
    generation: int


class PPEnqueueEvent(_Ev):
    """This step's FIFO entry pushed: ``pending`` (receive posted) or empty."""
    kind: Literal["pp.enqueue"] = "pp.enqueue"
    pending: bool


class BroadcastPostedEvent(_Ev):
    """This rank posted its side of the step's sampled-id broadcast."""
    kind: Literal["broadcast.posted"] = "broadcast.posted"
    rows: int


class BroadcastSkippedEvent(_Ev):
    """No row of the step needs a sample: no broadcast on this rank."""
    kind: Literal["broadcast.skipped"] = "broadcast.skipped"


class SampledEvent(_Ev):
    """Ids the last rank sampled for each row (rows of non-final chunks hold 0)."""
    kind: Literal["sampled"] = "sampled"
    req_ids: list[str]
    token_ids: list[list[int]]          # [num_rows, width]
    num_sampled: list[int]              # [num_rows]


class MirrorCheckEvent(_Ev):
    """CPU mirrors compared with device state after the step (invariant 4)."""
    kind: Literal["mirror.check"] = "mirror.check"
    slots: list[int]                    # [num_live] live slots, ascending
    num_computed_tokens: list[int]      # [num_live] mirror value per live slot (tokens)
    ok: bool = True
    message: str | None = None


class TimingEvent(_Ev):
    """A phase of a step on one rank, in monotonic nanoseconds (``time.monotonic_ns``)."""
    kind: Literal["timing"] = "timing"
    phase: Literal["forward", "sample", "send", "recv", "broadcast"]
    t0_ns: int
    t1_ns: int


EVENT_MODELS = (ArrivalEvent, AbortEvent, StopEvent, ResultEvent, LifecycleEvent, ScheduleEvent,
                TokensEvent, RankStepEvent, PPConsumeEvent, PPFreeEvent, PPEnqueueEvent,
                BroadcastPostedEvent, BroadcastSkippedEvent, SampledEvent, MirrorCheckEvent,
                TimingEvent)
TraceEvent = Annotated[Union[EVENT_MODELS], Field(discriminator="kind")]
_ADAPTER: TypeAdapter = TypeAdapter(TraceEvent)

SCHEDULER_INPUTS = frozenset({"arrival", "abort", "stop", "result"})
RANK_DECISIONS = frozenset({"rank.step", "pp.consume", "pp.free", "pp.enqueue", "broadcast.posted",
                            "broadcast.skipped", "sampled", "mirror.check"})


def parse_event(data: dict[str, Any]):
    """The typed event of one trace line.

    Raises:
        pydantic.ValidationError: unknown ``kind`` or fields that do not fit it.
    """
    return _ADAPTER.validate_python(data)


class RunHeader(BaseModel):
    """``header.json`` of one run directory.

    Attributes:
        format: always ``"ppstate-trace"``.
        version: :data:`TRACE_FORMAT_VERSION` of the writer.
        run_id: unique id of the run (also the directory name).
        source: ``engine`` (runtime.serve / generate / bench), ``sim`` (ppstate.sim) or another
            generator of complete runs (e.g. a model checker's counterexample); every source but
            ``engine`` is expected to end with nothing unfinished (liveness is checked).
        created_unix_s: wall-clock creation time (seconds since the epoch).
        pp_size: stages.
        scheduler: the SchedulerConfig fields (replay rebuilds the scheduler from them).
        config: the full configuration of the run (EngineConfig or SimConfig fields).
        seed: the run's seed (sim), or None.
        versions: package versions of the writer (python, ppstate, numpy, torch, ...).
        trace_prompts: whether arrivals carry prompt token ids.
        files: trace files of the run (``engine.jsonl``, ``rank0.jsonl``, ...).
        recorded_violations: a run whose writer checks invariants itself (the simulator): the
            violations it found, ``{invariant, step, rank, message[, slot, req_id]}`` (its first
            ones); None: the writer records none (the engine, traces written before them).
        num_recorded_violations: how many it found in all (``recorded_violations`` may hold
            fewer); None with ``recorded_violations``.
        mutants: known-bad variants (``ppstate.mutants``) that were switched on (simulator),
            or None.
        repro: the command that re-runs the writer on the same inputs (the simulator's command
            line), or None.
    """
    model_config = ConfigDict(extra="allow")
    format: Literal["ppstate-trace"] = "ppstate-trace"
    version: int = TRACE_FORMAT_VERSION
    run_id: str
    source: str
    created_unix_s: float
    pp_size: int
    scheduler: dict[str, Any]
    config: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    trace_prompts: bool = False
    files: list[str] = Field(default_factory=list)
    recorded_violations: list[dict[str, Any]] | None = None
    num_recorded_violations: int | None = None
    mutants: list[str] | None = None
    repro: str | None = None


#: header fields written only when set (not None): headers of writers that do not
#: set them (the engine, the model checker) read exactly as before the fields existed
OPTIONAL_HEADER_FIELDS = ("recorded_violations", "num_recorded_violations", "mutants", "repro")
