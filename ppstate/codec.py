"""Generic JSON encoding of the core's dataclasses (:class:`~ppstate.batch.SchedulerOutput` and
what it holds) for traces, and the way back.

The encoding walks ``dataclasses.fields`` instead of naming fields, so a field added to
``SchedulerOutput`` later (e.g. block-table deltas of a paged KV cache) is recorded and compared by
replay without touching this file, as long as it holds numpy arrays, dataclasses, tuples, lists,
dicts or JSON scalars. Prompt token ids are private: unless ``prompts=True`` a ``prompt_token_ids``
field is written as its length under ``prompt_len`` (replay only needs the length).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import numpy as np

from ppstate.batch import SchedulerOutput
from ppstate.blocks import block_hashes
from ppstate.budget import SchedulerConfig
from ppstate.events import EventSink
from ppstate.request import RequestSpec

PROMPT_FIELD = "prompt_token_ids"


#: per dataclass type: its field names, looked up once (``dataclasses.fields`` per value cost
#: most of a traced 256-row step's schedule event)
_FIELDS: dict[type, tuple[str, ...]] = {}
_SCALARS = (int, float, str, bool, type(None))


def encode(value: Any, prompts: bool = False) -> Any:
    """JSON-ready form of ``value``: dataclass -> dict of its fields, ndarray / tuple -> list,
    numpy scalar -> Python scalar; ``prompt_token_ids`` -> ``prompt_len`` unless ``prompts``."""
    t = type(value)
    if t is np.ndarray:
        return value.tolist()
    if t in _SCALARS:
        return value
    if (t is tuple or t is list) and value and type(value[0]) in _SCALARS:
        return list(value)   # typed fields (tuple[str, ...]): scalars throughout, one copy
    names = _FIELDS.get(t)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELDS[t] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        out = {}
        for name in names:
            v = getattr(value, name)
            if name == PROMPT_FIELD and not prompts:
                out["prompt_len"] = len(v)
            else:
                out[name] = encode(v, prompts)
        return out
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [encode(v, prompts) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v, prompts) for k, v in value.items()}
    if isinstance(value, (frozenset, set)):
        return sorted(encode(v, prompts) for v in value)
    return value


def decode(cls: type, data: dict) -> Any:
    """Rebuild dataclass ``cls`` from :func:`encode`'s output, guided by its type hints.

    ``np.ndarray`` fields become arrays (bool when the values are bools, else int32 for empty
    lists), ``tuple[X, ...]`` of dataclasses become tuples of ``X``; a missing ``prompt_token_ids``
    is rebuilt as zeros of length ``prompt_len``. Fields unknown to ``cls`` are ignored.

    Raises:
        TypeError / KeyError: ``data`` lacks a required field of ``cls``.
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == PROMPT_FIELD and f.name not in data and "prompt_len" in data:
            kwargs[f.name] = (0,) * int(data["prompt_len"])
        elif f.name in data:
            kwargs[f.name] = _decode_value(hints[f.name], data[f.name])
    return cls(**kwargs)


def _decode_value(hint: Any, value: Any) -> Any:
    if hint is np.ndarray:
        arr = np.asarray(value)
        return np.zeros(0, dtype=np.int32) if arr.size == 0 and arr.ndim == 1 else arr
    origin = typing.get_origin(hint)
    if origin is tuple:
        args = typing.get_args(hint)
        inner = args[0] if args else Any
        if dataclasses.is_dataclass(inner):
            return tuple(decode(inner, v) for v in value)
        return tuple(value)
    if dataclasses.is_dataclass(hint):
        return decode(hint, value)
    return value


def encode_output(out: SchedulerOutput, prompts: bool = False) -> dict:
    """Every field of one step's SchedulerOutput (see :func:`encode`)."""
    return encode(out, prompts)


def decode_output(data: dict) -> SchedulerOutput:
    """The SchedulerOutput recorded as ``data`` (its ``is_final_chunk`` as bool)."""
    out = decode(SchedulerOutput, data)
    i32 = {f: np.asarray(getattr(out, f), dtype=np.int32)
           for f in ("slots", "num_scheduled_tokens", "start_positions")}
    digests = None if out.block_digests is None else np.asarray(out.block_digests, dtype=np.int64)
    return dataclasses.replace(out, is_final_chunk=np.asarray(out.is_final_chunk, dtype=bool),
                               block_digests=digests, **i32)


def arrival_fields(spec: RequestSpec, sink: EventSink, config: SchedulerConfig) -> dict:
    """Fields of the ``arrival`` event of ``spec``: lengths and sampling parameters; prompt
    token ids only when ``sink.trace_prompts``. Without them, and with prefix caching on, the
    chained hashes of the prompt's full blocks (``prefix_hashes``) are recorded instead: they decide
    prefix-cache hits, so replay needs them, and they do not reveal the prompt."""
    ids = list(spec.prompt_token_ids) if sink.trace_prompts else None
    hashes = (block_hashes(spec.prompt_token_ids, config.block_size)
              if ids is None and config.enable_prefix_caching else None)
    return {"req_id": spec.req_id, "prompt_len": spec.prompt_len, "max_tokens": spec.max_tokens,
            "eos_token_ids": sorted(spec.eos_token_ids),
            "stop_token_ids": sorted(spec.stop_token_ids), "ignore_eos": spec.ignore_eos,
            "sampling": dict(spec.sampling), "prompt_token_ids": ids, "prefix_hashes": hashes,
            "fork_of": spec.fork_of, "prefix_cache": spec.prefix_cache}
