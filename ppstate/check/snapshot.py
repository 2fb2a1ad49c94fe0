"""Copying and fingerprinting a model-checker state: its pickle.

The pickle is the state's complete copy (frontier states travel as pickles, also to the
``--jobs`` workers); the fingerprint of a (canonical, :mod:`ppstate.check.canon`) state is a
64-bit hash of its pickle. Reducers keep the pickle small and fast:

* objects that never change during a run are not copied: the scheduler's
  :class:`~ppstate.budget.SchedulerConfig` and the checker's ``CheckConfig`` (frozen) and the
  read-only parts of
  :class:`~ppstate.block_states.BlockStates` (its machine table, edge vectors and spec; only the
  per-block ``code`` array is state) travel as an index into a table of this process (filled
  before ``--jobs`` workers fork, so they share it);
* a restored object names its attributes with interned strings, as a constructed one does (a
  pickle memoizes strings by identity: equal states must pickle alike);
* the request lifecycle machine (``transitions``) travels as its models (each request carries
  its ``state``); a restored lifecycle fires through one machine per process
  (:class:`LazyLifecycle`);
* numpy arrays travel as bytes, dtype name and shape.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import pickle
import sys
from functools import partial
from typing import Any

import numpy as np

from ppstate.block_states import BlockStates
from ppstate.budget import SchedulerConfig
from ppstate.lifecycle import Lifecycle
from ppstate.request import Request

_PROTO = pickle.HIGHEST_PROTOCOL
_LIFECYCLE: dict[str, Any] = {}   # a built Lifecycle's fields but the machine, shared
_SHARED: list[Any] = []           # constant objects of this process, by index
_SHARED_INDEX: dict[int, int] = {}   # id(object) -> index in _SHARED
_BY_VALUE: dict[Any, int] = {}       # value key -> index: equal constants get one index
_KEEP: list[Any] = []             # every object named in _SHARED_INDEX stays alive (no id reuse)


def _register(obj: Any, value_key: Any, shared: Any) -> int:
    index = _BY_VALUE.get(value_key)
    if index is None:
        index = _BY_VALUE[value_key] = len(_SHARED)
        _SHARED.append(shared)
    _SHARED_INDEX[id(obj)] = index
    _KEEP.append(obj)
    return index


def share(obj: Any) -> None:
    """Make ``obj`` travel by reference: pickles of this process (and of processes forked after
    this call) name it by index instead of copying it. Equal configurations get one index, so
    equal states of different runs pickle alike."""
    if id(obj) not in _SHARED_INDEX:
        _register(obj, ("config", obj), obj)


def _shared(index: int) -> Any:
    return _SHARED[index]


def _reduce_config(cfg: Any):
    index = _SHARED_INDEX.get(id(cfg))
    if index is None:
        return cfg.__reduce_ex__(_PROTO)
    return _shared, (index,)


def _rebuild_block_states(index: int, code: bytes) -> BlockStates:
    bs = BlockStates.__new__(BlockStates)
    bs.__dict__.update(_SHARED[index])
    bs.code = np.frombuffer(code, dtype=np.int8).copy()   # [num_blocks]
    return bs


def _reduce_block_states(bs: BlockStates):
    """``code`` is the only field that changes; the rest (spec, machine, edge vectors) is shared
    by every BlockStates of an equal table (keyed by its ``_allowed`` dict, kept alive)."""
    index = _SHARED_INDEX.get(id(bs._allowed))
    if index is None:
        table = (tuple(bs.table.state_names),
                 tuple((t.trigger, tuple(t.source), t.dest) for t in bs.table.transitions))
        index = _register(bs._allowed, ("blocks", table),
                          {k: v for k, v in vars(bs).items() if k != "code"})
    return _rebuild_block_states, (index, bs.code.tobytes())


def _new_request() -> Request:
    return Request.__new__(Request)


def _reduce_request(req: Request):
    """The state goes through the unpickler's BUILD, which interns the attribute names: a
    pickle memoizes strings by identity, so a restored request must name its attributes with the
    same string objects as a constructed one, or equal states would pickle differently."""
    return _new_request, (), {k: v for k, v in vars(req).items() if not callable(v)}


class LazyLifecycle(Lifecycle):
    """A :class:`Lifecycle` restored from a pickle. Building a ``transitions`` machine and adding
    the models to it (which attaches some twenty trigger and ``is_<state>`` methods to each) cost
    about a millisecond, more than the rest of most transitions, so a restored lifecycle fires
    its edges through one machine per process (:func:`_machine`, built from the same spec) and
    keeps its models itself (``_models``, admission order): a restored request gets the one
    method :meth:`Lifecycle.fire` calls (``trigger``, the machine's own) on its first edge, and a
    request added later goes through the machine's ``add_model`` as in the scheduler's own
    lifecycle. The machine decides every edge (guards, destination, ``state``); ppstate calls
    only ``add``, ``remove`` and ``fire``."""

    def add(self, request) -> None:
        machine = _machine()
        machine.add_model(request, initial=self.table.initial)
        machine.remove_model(request)   # the machine holds no models: each world keeps its own
        self._models.append(request)

    def remove(self, request) -> None:
        self._models.remove(request)

    def fire(self, request, trigger: str) -> str:
        if "trigger" not in request.__dict__:
            request.trigger = partial(_machine()._get_trigger, request)
        return super().fire(request, trigger)


_MACHINE: list[Any] = []   # the process's lifecycle machine (no models)


def _machine() -> Any:
    if not _MACHINE:
        _MACHINE.append(Lifecycle().machine)
    return _MACHINE[0]


def _rebuild_lifecycle(models: list[Request]) -> Lifecycle:
    if not _LIFECYCLE:
        _LIFECYCLE.update({k: v for k, v in vars(Lifecycle()).items() if k != "machine"})
    lc = LazyLifecycle.__new__(LazyLifecycle)
    lc.__dict__.update(_LIFECYCLE)
    lc._models = models
    return lc


def _reduce_lifecycle(lc: Lifecycle):
    """The models in order; each one's ``state`` travels with the request itself."""
    models = lc.__dict__.get("_models")
    return _rebuild_lifecycle, (list(models if models is not None else lc.machine.models),)


def _array(data: bytes, dtype: str, shape: tuple) -> np.ndarray:
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


_DTYPE_NAMES: dict[np.dtype, str] = {}   # one string object per dtype: memoized in a pickle


def _reduce_array(a: np.ndarray):
    """An array travels as its bytes, dtype name and shape: numpy's own reduction names a dtype
    object, which a constructed array shares with every array of its dtype and a restored one
    does not (equal states would pickle differently)."""
    if a.dtype.hasobject:
        return a.__reduce_ex__(_PROTO)
    name = _DTYPE_NAMES.get(a.dtype)
    if name is None:
        name = _DTYPE_NAMES[a.dtype] = sys.intern(a.dtype.str)
    return _array, (a.tobytes(), name, a.shape)


_TABLE = copyreg.dispatch_table.copy()
_TABLE.update({Lifecycle: _reduce_lifecycle, LazyLifecycle: _reduce_lifecycle,
               Request: _reduce_request, np.ndarray: _reduce_array,
               SchedulerConfig: _reduce_config, BlockStates: _reduce_block_states})


def constant_type(cls: type) -> None:
    """Let frozen objects of ``cls`` passed to :func:`share` travel by reference too."""
    _TABLE[cls] = _reduce_config


def dumps(obj: Any) -> bytes:
    """The state's pickle (see the module docstring)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, _PROTO)
    p.dispatch_table = _TABLE
    p.dump(obj)
    return buf.getvalue()


loads = pickle.loads


def digest(data: bytes) -> bytes:
    """16-byte digest of a pickled state (the ``--no-canon`` key)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def fingerprint(data: bytes) -> int:
    """64-bit fingerprint of a pickled canonical state (BLAKE2b; docs/checker.md gives the
    collision probability)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
