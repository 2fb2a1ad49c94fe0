"""Copying and hashing a model-checker state: its pickle.

The pickle is the state's complete copy (frontier states travel as pickles, also to the
``--jobs`` workers); its digest is the ``--no-canon`` key, and :mod:`ppstate.check.canon` hashes
a scrubbed copy's pickle. Two reducers keep the pickle small and
fast: the request lifecycle machine (``transitions``) is rebuilt from its models and their states
instead of being pickled with every bound trigger method, and small 1-d numpy arrays travel as
lists.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import pickle
from typing import Any

import numpy as np

from ppstate.lifecycle import Lifecycle
from ppstate.request import Request

_PROTO = pickle.HIGHEST_PROTOCOL
_LIFECYCLE: dict[str, Any] = {}   # a built Lifecycle's fields but the machine, shared


def _rebuild_request(state: dict) -> Request:
    req = Request.__new__(Request)
    req.__dict__.update(state)
    return req


def _reduce_request(req: Request):
    return _rebuild_request, ({k: v for k, v in vars(req).items() if not callable(v)},)


def _rebuild_lifecycle(models: list[tuple[Request, str]]) -> Lifecycle:
    if not _LIFECYCLE:
        _LIFECYCLE.update({k: v for k, v in vars(Lifecycle()).items() if k != "machine"})
    lc = Lifecycle.__new__(Lifecycle)
    lc.__dict__.update(_LIFECYCLE)
    lc.machine = Lifecycle(lc.spec).machine
    for model, state in models:
        lc.machine.add_model(model, initial=state)
    return lc


def _reduce_lifecycle(lc: Lifecycle):
    return _rebuild_lifecycle, ([(m, m.state) for m in lc.machine.models],)


def _array(values: list, dtype: str) -> np.ndarray:
    return np.array(values, dtype=dtype)


def _reduce_array(a: np.ndarray):
    if a.ndim == 1 and a.size <= 64:
        return _array, (a.tolist(), a.dtype.str)
    return a.__reduce_ex__(_PROTO)


_TABLE = copyreg.dispatch_table.copy()
_TABLE.update({Lifecycle: _reduce_lifecycle, Request: _reduce_request, np.ndarray: _reduce_array})


def dumps(obj: Any) -> bytes:
    """The state's pickle (see the module docstring)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, _PROTO)
    p.dispatch_table = _TABLE
    p.dump(obj)
    return buf.getvalue()


loads = pickle.loads


def digest(data: bytes) -> bytes:
    """16-byte key of a pickled state."""
    return hashlib.blake2b(data, digest_size=16).digest()
