"""Engine <-> worker messages: msgspec Structs encoded as msgpack (never pickle).

A message is one of :data:`Message`, a tagged union (msgpack key ``"type"``). Every message has a
``kind`` string: ``"step"``, ``"result"``, ``"error"``, ``"ready"``, ``"heartbeat"``, or for :class:`ControlMsg`
its own ``"shutdown"`` | ``"corrupt_state"`` | ``"ping"``. numpy arrays travel as
:class:`NdArray` (dtype string incl. byte order, shape, raw bytes) and come back as writable
arrays of the same dtype and shape. :func:`decode` raises :class:`TransportError` for anything
that is not a well-formed message (garbage bytes, unknown tag, wrong field types, bad arrays).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, Union

import msgspec
import numpy as np

from ppstate.batch import FreedSlot, NewRequest, SchedulerOutput, StepResult
from ppstate.errors import PPStateError
from runtime.sampling.step_logprobs import PromptLogprobs, StepLogprobs


class TransportError(PPStateError):
    """A message could not be encoded or decoded (the cause is chained and named)."""


class NdArray(msgspec.Struct, array_like=True, frozen=True):
    """A numpy array on the wire: ``dtype`` is ``np.dtype.str`` (e.g. ``'<i4'``, ``'|b1'``)."""
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> "NdArray":
        a = np.asarray(a)
        if a.dtype.hasobject:
            raise TransportError(f"cannot send an object array (dtype {a.dtype})")
        return cls(a.dtype.str, tuple(int(d) for d in a.shape), np.ascontiguousarray(a).tobytes())

    def to_numpy(self) -> np.ndarray:
        """A writable copy. Raises TransportError on a bad dtype or a size mismatch."""
        try:
            dt = np.dtype(self.dtype)
        except TypeError as e:
            raise TransportError(f"bad array dtype {self.dtype!r}") from e
        if dt.hasobject or any(d < 0 for d in self.shape):
            raise TransportError(f"bad array dtype/shape {self.dtype!r} {self.shape}")
        want = math.prod(self.shape) * dt.itemsize
        if len(self.data) != want:
            raise TransportError(f"array {self.dtype} {self.shape} needs {want} bytes, "
                                 f"got {len(self.data)}")
        return np.frombuffer(self.data, dtype=dt).reshape(self.shape).copy()


class LogprobArrays(msgspec.Struct, array_like=True):
    """:class:`~runtime.sampling.step_logprobs.StepLogprobs` on the wire (each field an NdArray)."""
    rows: NdArray
    logprobs: NdArray
    ks: NdArray
    top_ids: NdArray
    top_logprobs: NdArray

    @classmethod
    def of(cls, lp: StepLogprobs) -> "LogprobArrays":
        return cls(*(NdArray.of(getattr(lp, f)) for f in cls.__struct_fields__))

    def to_step_logprobs(self) -> StepLogprobs:
        """Raises TransportError for arrays of inconsistent shapes."""
        try:
            return StepLogprobs(*(getattr(self, f).to_numpy() for f in self.__struct_fields__))
        except ValueError as e:
            raise TransportError(str(e)) from e


class PromptLogprobArrays(msgspec.Struct, array_like=True):
    """:class:`~runtime.sampling.prompt_logprobs.PromptLogprobs` on the wire (each field an NdArray)."""
    rows: NdArray
    positions: NdArray
    token_ids: NdArray
    logprobs: NdArray
    ks: NdArray
    top_ids: NdArray
    top_logprobs: NdArray

    @classmethod
    def of(cls, lp: PromptLogprobs) -> "PromptLogprobArrays":
        return cls(*(NdArray.of(getattr(lp, f)) for f in cls.__struct_fields__))

    def to_prompt_logprobs(self) -> PromptLogprobs:
        return PromptLogprobs(*(getattr(self, f).to_numpy() for f in self.__struct_fields__))


class _Msg(msgspec.Struct, tag_field="type", kw_only=True):
    @property
    def kind(self) -> str:
        return self.__struct_config__.tag


class NewRequestMsg(msgspec.Struct, array_like=True):
    """:class:`~ppstate.batch.NewRequest` on the wire (``sampling``: runtime sampling params)."""
    req_id: str
    slot: int
    prompt_token_ids: list[int]
    max_seq_len: int
    sampling: dict[str, Any] = {}
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


class FreedSlotMsg(msgspec.Struct, array_like=True):
    """:class:`~ppstate.batch.FreedSlot` on the wire."""
    req_id: str
    slot: int
    reason: str


class StepMsg(_Msg, tag="step"):
    """One :class:`~ppstate.batch.SchedulerOutput`; each ``[num_rows]`` array is an NdArray."""
    step: int
    req_ids: list[str]
    slots: NdArray
    num_scheduled_tokens: NdArray
    start_positions: NdArray
    is_final_chunk: NdArray
    new_requests: list[NewRequestMsg] = []
    freed: list[FreedSlotMsg] = []
    block_table: NdArray | None = None  # [3, U] int32: slots, cols, block ids (KV deltas)
    block_digests: NdArray | None = None  # [num_rows] int64: digest of each row's block ids


class ResultMsg(_Msg, tag="result"):
    """A rank's answer to a step: timing always; the :class:`~ppstate.batch.StepResult` arrays
    only from the last rank (``None`` from the others, see :meth:`timing_only`).

    Attributes:
        busy_s: seconds this rank spent computing the step (forward, sampling), not waiting.
        dropped_rows: deferred rows this rank's PPHandler dropped as stale so far (cumulative;
            0 on the last rank).
        logprobs: optional msgpack-able payload (numpy scalars/arrays become Python numbers/lists):
            per-row lists (speculative decoding's verify).
        logprob_arrays: the step's logprobs as arrays
            (:class:`~runtime.sampling.step_logprobs.StepLogprobs`, the sampler's payload); at most
            one of ``logprobs`` / ``logprob_arrays`` is set.
        prompt_logprobs: the prompt tokens the step's prefill rows scored, or None.
    """
    step: int
    rank: int
    busy_s: float = 0.0
    dropped_rows: int = 0
    sampled_token_ids: NdArray | None = None
    num_sampled: NdArray | None = None
    num_rejected: NdArray | None = None
    logprobs: Any = None
    logprob_arrays: LogprobArrays | None = None
    prompt_logprobs: PromptLogprobArrays | None = None

    @classmethod
    def timing_only(cls, step: int, rank: int, busy_s: float, dropped_rows: int = 0) -> "ResultMsg":
        """A non-last rank's reply: no sampled tokens, only its timing (and its count of
        dropped deferred rows)."""
        return cls(step=step, rank=rank, busy_s=float(busy_s), dropped_rows=int(dropped_rows))

    @property
    def has_result(self) -> bool:
        return self.sampled_token_ids is not None


class ControlMsg(_Msg, tag="control"):
    """Engine -> rank control. ``corrupt_state`` is a test hook: add ``delta`` to device state
    ``field`` of ``slot`` on ``rank`` (mirror validation must then fail); it needs all four.
    ``warm_grammar`` (to the last rank, when the server meets its first structured-output
    request): load the grammar engine in the background, so no step waits for it."""
    kind: Literal["shutdown", "corrupt_state", "ping", "warm_grammar"]
    rank: int | None = None
    slot: int | None = None
    field: str | None = None
    delta: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "corrupt_state" and None in (self.rank, self.slot, self.field, self.delta):
            raise ValueError("corrupt_state needs rank, slot, field and delta")


class ErrorMsg(_Msg, tag="error"):
    """A rank failed: exception type name, message and formatted traceback."""
    rank: int
    step: int | None
    error_type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, rank: int, step: int | None, exc: BaseException) -> "ErrorMsg":
        """ErrorMsg describing ``exc`` (type name, ``str(exc)``, full formatted traceback)."""
        import traceback as tb
        return cls(rank=rank, step=step, error_type=type(exc).__name__, message=str(exc),
                   traceback="".join(tb.format_exception(exc)))


class ReadyMsg(_Msg, tag="ready"):
    """A rank finished setup; ``info`` is free-form (layer range, device, ...)."""
    rank: int
    info: dict[str, Any] = {}


class HeartbeatMsg(_Msg, tag="heartbeat"):
    """Rank -> engine, every :data:`runtime.worker.heartbeat.HEARTBEAT_INTERVAL_S` seconds from
    a thread of its own: the process is alive and not frozen. ``step`` is the step the rank is in
    (or last finished; -1 before the first), ``in_step_s`` the seconds spent in it so far
    (0.0 while idle); ``phase`` the part of the step the rank is in (``idle`` between steps; see
    :mod:`runtime.worker.progress`), ``in_phase_s`` the seconds spent in that phase so far,
    ``steps_done`` the steps the rank finished."""
    rank: int
    step: int
    in_step_s: float = 0.0
    phase: str = "idle"
    in_phase_s: float = 0.0
    steps_done: int = 0


Message = Union[StepMsg, ResultMsg, ControlMsg, ErrorMsg, ReadyMsg, HeartbeatMsg]
_DECODER = msgspec.msgpack.Decoder(Message)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if hasattr(obj, "model_dump"):  # pydantic models, e.g. SamplingParams
        return obj.model_dump()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def encode(msg: Message) -> bytes:
    """msgpack bytes of ``msg``. Raises TransportError for unencodable payloads."""
    if not isinstance(msg, (StepMsg, ResultMsg, ControlMsg, ErrorMsg, ReadyMsg, HeartbeatMsg)):
        raise TransportError(f"not a message: {type(msg).__name__}")
    try:
        return msgspec.msgpack.encode(msg, enc_hook=_enc_hook)
    except (TypeError, NotImplementedError, OverflowError) as e:
        raise TransportError(f"cannot encode {type(msg).__name__}: {e}") from e


_NEW_REQUEST_DECODER = msgspec.msgpack.Decoder(NewRequestMsg)


def new_request_round_trip(req: NewRequestMsg) -> NewRequestMsg:
    """``req`` after the trip a step takes to a worker (msgpack encode, then decode).

    The engine runs this once per request at admission, so a value that cannot travel (an integer
    beyond 64 bits, a string that is not UTF-8, an unknown object) fails that request alone
    instead of the step that would carry it.

    Raises:
        TransportError: ``req`` cannot be encoded or does not decode back.
    """
    try:
        data = msgspec.msgpack.encode(req, enc_hook=_enc_hook)
        return _NEW_REQUEST_DECODER.decode(data)
    except (TypeError, NotImplementedError, OverflowError, UnicodeError, msgspec.DecodeError) as e:
        raise TransportError(f"cannot encode request {req.req_id!r}: {type(e).__name__}: {e}") from e


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data``. Raises TransportError (from msgspec.DecodeError) if malformed."""
    try:
        return _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise TransportError(f"malformed message ({len(data)} bytes): {e}") from e


def from_scheduler_output(out: SchedulerOutput,
                          sampling: Mapping[str, Mapping[str, Any] | Any] | None = None) -> StepMsg:
    """StepMsg of ``out``; ``sampling[req_id]`` (dict or pydantic model) overrides a new
    request's own ``sampling``."""
    sampling = sampling or {}

    def params(nr: NewRequest) -> dict[str, Any]:
        p = sampling.get(nr.req_id, nr.sampling)
        return p.model_dump() if hasattr(p, "model_dump") else dict(p)

    return StepMsg(
        step=int(out.step), req_ids=list(out.req_ids), slots=NdArray.of(out.slots),
        num_scheduled_tokens=NdArray.of(out.num_scheduled_tokens),
        start_positions=NdArray.of(out.start_positions), is_final_chunk=NdArray.of(out.is_final_chunk),
        new_requests=[NewRequestMsg(nr.req_id, int(nr.slot), [int(t) for t in nr.prompt_token_ids],
                                    int(nr.max_seq_len), params(nr), int(nr.num_cached_tokens),
                                    int(nr.num_output_tokens)) for nr in out.new_requests],
        freed=[FreedSlotMsg(f.req_id, int(f.slot), f.reason) for f in out.freed],
        block_table=NdArray.of(np.stack([out.block_table_slots, out.block_table_cols,
                                         out.block_table_ids]).astype(np.int32)),
        block_digests=None if out.block_digests is None else NdArray.of(out.block_digests))


def to_scheduler_output(msg: StepMsg) -> SchedulerOutput:
    """The SchedulerOutput in ``msg``. Raises TransportError if row arrays disagree in length."""
    arrays = [a.to_numpy() for a in (msg.slots, msg.num_scheduled_tokens, msg.start_positions,
                                     msg.is_final_chunk)]
    rows = len(msg.req_ids)
    if any(a.shape != (rows,) for a in arrays):
        raise TransportError(f"step {msg.step}: row arrays {[a.shape for a in arrays]} do not "
                             f"match {rows} req_ids")
    bt = (msg.block_table.to_numpy() if msg.block_table is not None
          else np.zeros((3, 0), dtype=np.int32))
    return SchedulerOutput(
        msg.step, tuple(msg.req_ids), *arrays,
        new_requests=tuple(NewRequest(n.req_id, n.slot, tuple(n.prompt_token_ids), n.max_seq_len,
                                      dict(n.sampling), n.num_cached_tokens, n.num_output_tokens)
                           for n in msg.new_requests),
        freed=tuple(FreedSlot(f.req_id, f.slot, f.reason) for f in msg.freed),
        block_table_slots=bt[0], block_table_cols=bt[1], block_table_ids=bt[2],
        block_digests=None if msg.block_digests is None else msg.block_digests.to_numpy())


def from_step_result(res: StepResult, rank: int, busy_s: float = 0.0) -> ResultMsg:
    """ResultMsg of the last rank's ``res`` (its ``logprobs`` travel as the payload)."""
    arrays = isinstance(res.logprobs, StepLogprobs)
    return ResultMsg(step=int(res.step), rank=rank, busy_s=float(busy_s),
                     sampled_token_ids=NdArray.of(res.sampled_token_ids),
                     num_sampled=NdArray.of(res.num_sampled),
                     num_rejected=NdArray.of(res.num_rejected),
                     logprobs=None if arrays else res.logprobs,
                     logprob_arrays=LogprobArrays.of(res.logprobs) if arrays else None,
                     prompt_logprobs=None if res.prompt_logprobs is None
                     else PromptLogprobArrays.of(res.prompt_logprobs))


def to_step_result(msg: ResultMsg) -> StepResult:
    """The StepResult in ``msg``. Raises TransportError for a timing-only reply."""
    if not msg.has_result or msg.num_sampled is None or msg.num_rejected is None:
        raise TransportError(f"step {msg.step}: rank {msg.rank} sent no sampled tokens")
    lps = msg.logprobs if msg.logprob_arrays is None else msg.logprob_arrays.to_step_logprobs()
    plps = None if msg.prompt_logprobs is None else msg.prompt_logprobs.to_prompt_logprobs()
    return StepResult(msg.step, msg.sampled_token_ids.to_numpy(), msg.num_sampled.to_numpy(),
                      msg.num_rejected.to_numpy(), lps, plps)
