"""Which failures end one request and which stop the engine: the one place that decides.

A **request failure** belongs to a single request: the work that raised only ever touches that
request's own data. It ends that request (its stream gets ``error`` with ``error_kind``
``"request"``; the server answers 500 ``request_failed``, or 400 for the input stages) and the engine
and every other request keep running. The stages, in the order a request meets them:

==================  =====================================================================  =========
stage               what runs                                                              where
==================  =====================================================================  =========
``tokenize``        prompt / chat template -> token ids                                    server
``sampling_params`` the request's :class:`~runtime.sampling_params.SamplingParams`, built  engine
                    from its wire form exactly as the last rank builds them
``encode``          its ``NewRequestMsg`` through the msgpack encoder and decoder          engine
``stop_strings``    building its stop-string matcher (the incremental detokenizer)          engine
``detokenize``      token ids -> text, stop-string matching, per step                      engine
``logprobs``        its logprob entries of a step                                          engine
==================  =====================================================================  =========

The admission stages (``sampling_params``, ``encode``, ``stop_strings``) run in
``AsyncEngine.add_request`` *before* the request reaches the scheduler, on the very values the
workers receive, so nothing a request carries can make a step's message unencodable or a worker's
parameter build fail.

An **engine failure** is a failure of a step itself and stops the engine (every open stream ends
with ``error_kind`` ``"engine"``, ``/health`` turns 503): a worker reports an exception from a step
(``ErrorMsg``: a collective timed out, a mirror diverged, a kernel failed), a worker process died,
no step finished within ``step_timeout_s``, or the engine's own step/result loop raised outside a
request scope. Whatever escapes :func:`request_scope` is, by construction, an engine failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

REQUEST_STAGES = ("tokenize", "sampling_params", "encode", "stop_strings", "detokenize", "logprobs")
#: stages whose failure is decided by the request's input alone (the server answers 400)
INPUT_STAGES = frozenset({"tokenize"})
REQUEST, ENGINE = "request", "engine"
#: the request was ended because the server is stopping (SIGINT/SIGTERM): neither it nor the engine failed
SHUTDOWN = "shutdown"


class RequestFailure(Exception):
    """One request failed at ``stage``; the engine is unaffected.

    Attributes:
        req_id: the request.
        stage: one of :data:`REQUEST_STAGES`.
        cause: the original exception (also chained as ``__cause__``).
    """

    def __init__(self, req_id: str, stage: str, cause: BaseException) -> None:
        if stage not in REQUEST_STAGES:
            raise ValueError(f"unknown request stage {stage!r}")
        self.req_id, self.stage, self.cause = req_id, stage, cause
        super().__init__(f"request {req_id!r} failed while {_VERB[stage]}: "
                         f"{type(cause).__name__}: {cause}")


_VERB = {"tokenize": "tokenizing its input", "sampling_params": "building its sampling parameters",
         "encode": "encoding it into a worker message", "stop_strings": "building its stop-string matcher",
         "detokenize": "detokenizing its output", "logprobs": "building its logprobs"}


@contextmanager
def request_scope(req_id: str, stage: str) -> Iterator[None]:
    """Run a block that touches only ``req_id``'s data: any ``Exception`` it raises becomes a
    :class:`RequestFailure` (``BaseException`` such as cancellation passes through unchanged).

    Raises:
        RequestFailure: the block raised.
    """
    if stage not in REQUEST_STAGES:
        raise ValueError(f"unknown request stage {stage!r}")
    try:
        yield
    except RequestFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - the point: everything here belongs to one request
        raise RequestFailure(req_id, stage, exc) from exc


def classify(exc: BaseException) -> str:
    """:data:`REQUEST` for a :class:`RequestFailure`, :data:`ENGINE` for anything else."""
    return REQUEST if isinstance(exc, RequestFailure) else ENGINE
