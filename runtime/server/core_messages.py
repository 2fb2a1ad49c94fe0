"""Messages between API-server processes and the engine-core process (``--api-server-count``).

Every message is a msgpack array (msgspec) whose first element names its kind; nothing is
pickled. Frontend -> core (one PULL socket in the core):

* ``["add", frontend, req_id, prompt_token_ids, sampling_params_dict, fork_of]``
* ``["abort", req_id]``

Core -> frontend ``k`` (one PULL socket per frontend):

* ``["ready", info]``: the engine is up; ``info`` = model name, vocabulary size, scheduler limits.
* ``["dead", message]``: the engine failed to start or died.
* ``["outs", [output, ...]]``: stream increments, in order per request (:func:`pack_output`).
* ``["reject", req_id, field, message, kind]``: the core refused ``add`` (``kind``: ``rejected``,
  ``failed`` or ``dead``, for RequestRejected / RequestFailure / EngineDeadError).
* ``["stats", stats_dict, alive, error]``: the engine's ``stats()``, every ``STATS_INTERVAL_S``
  (also the frontends' sign that the core lives).
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.engine.outputs import RequestOutput, TokenLogprob

STATS_INTERVAL_S = 0.5
#: a frontend that hears nothing from the core for this long treats the engine as dead
CORE_SILENCE_S = 10.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode(msg: list) -> bytes:
    """One message as msgpack bytes."""
    return _encoder.encode(msg)


def decode(data: bytes) -> list:
    """One message from msgpack bytes.

    Raises:
        msgspec.DecodeError: not a msgpack message.
    """
    return _decoder.decode(data)


def pack_output(out: RequestOutput) -> list:
    """A :class:`RequestOutput` as a msgpack-ready list (logprobs as ``[id, logprob, top]``)."""
    lps = None if out.logprobs is None else [[lp.token_id, lp.logprob, lp.top] for lp in out.logprobs]
    plps = None if out.prompt_logprobs is None else [
        None if lp is None else [lp.token_id, lp.logprob, lp.top] for lp in out.prompt_logprobs]
    return [out.req_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
            out.num_prompt_tokens, out.num_output_tokens, lps, out.error, out.error_kind,
            out.scheduled_s, out.queue_s, out.num_cached_tokens, plps]


def unpack_output(row: list[Any]) -> RequestOutput:
    """The inverse of :func:`pack_output` (``top`` keys back to int token ids)."""
    (req_id, ids, text, finished, reason, n_prompt, n_out, lps, error, kind, sched_s, queue_s,
     n_cached, plps) = row
    logprobs = None if lps is None else [_token_logprob(x) for x in lps]
    prompt_logprobs = None if plps is None else [
        None if x is None else _token_logprob(x) for x in plps]
    return RequestOutput(req_id, list(ids), text, finished, reason, n_prompt, n_out, logprobs,
                         error, kind, sched_s, queue_s, num_cached_tokens=n_cached,
                         prompt_logprobs=prompt_logprobs)


def _token_logprob(row: list[Any]) -> TokenLogprob:
    """``[id, logprob, top]`` back to a :class:`TokenLogprob` (``top`` keys to int token ids)."""
    t, lp, top = row
    return TokenLogprob(int(t), float(lp), {int(k): float(v) for k, v in top.items()})
