"""Checks a request passes before the scheduler sees it: its id, its prompt (non-empty, inside
the vocabulary, shorter than ``max_model_len``), its fit in the KV cache, and the work the last
rank will do on its sampling parameters (run here first, so a request whose parameters cannot be
built fails alone instead of failing the rank)."""

from __future__ import annotations

from ppstate.budget import SchedulerConfig
from runtime.engine.errors import RequestRejected
from runtime.engine.faults import request_scope
from runtime.messages import NewRequestMsg, new_request_round_trip
from runtime.sampling.batch import SamplingBatch
from runtime.sampling_params import SamplingParams


def check_prompt(ids: list[int], vocab_size: int, config: SchedulerConfig) -> None:
    """A prompt must be non-empty, leave room for one new token and hold only vocabulary ids.

    Raises:
        RequestRejected: field ``prompt``.
    """
    if not ids:
        raise RequestRejected("prompt", "the prompt is empty")
    if config.output_room(len(ids)) < 1:
        raise RequestRejected(
            "prompt", f"the prompt has {len(ids)} tokens; this server's max_model_len is "
            f"{config.max_model_len} (prompt + at least one new token must fit)")
    bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
    if bad is not None:
        raise RequestRejected("prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_kv_fit(prompt_len: int, max_tokens: int, config: SchedulerConfig) -> None:
    """A request whose prompt + max_tokens can never fit the KV cache is rejected (400).

    Raises:
        RequestRejected: field ``prompt`` (the prompt alone is too long) or ``max_tokens``.
    """
    cap = config.kv_capacity_tokens
    need = prompt_len + min(max_tokens, config.output_room(prompt_len)) - 1
    if prompt_len > cap:
        raise RequestRejected("prompt", f"the prompt has {prompt_len} tokens; this server's "
                              f"KV cache holds {cap} tokens")
    if need > cap:
        raise RequestRejected("max_tokens", f"prompt ({prompt_len} tokens) + max_tokens "
                              f"({max_tokens}) needs KV cache for {need} tokens; this "
                              f"server's KV cache holds {cap} tokens")


def admission_checks(req_id: str, prompt: tuple[int, ...], params: SamplingParams,
                     max_model_len: int) -> dict:
    """The request's sampling dict after the worker-message round trip, with the last rank's
    own parameter build (``SamplingParams`` + a one-row ``SamplingBatch``) run on it here.

    Raises:
        RequestFailure: stage ``encode`` or ``sampling_params``.
    """
    with request_scope(req_id, "encode"):
        wire = new_request_round_trip(NewRequestMsg(req_id, 0, list(prompt), max_model_len,
                                                    params.model_dump()))
    with request_scope(req_id, "sampling_params"):
        SamplingBatch.build([SamplingParams(**wire.sampling)], [0], "cpu")
    return dict(wire.sampling)
