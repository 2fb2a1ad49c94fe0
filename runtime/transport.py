"""Engine <-> worker transport over pyzmq PUSH/PULL, carrying :mod:`runtime.messages`.

Re-exports the message API (``encode``, ``decode``, the ``*Msg`` Structs, conversions,
``TransportError``) so callers need one import, and adds socket helpers:
:func:`ipc_address` / :func:`tcp_address` for endpoints, :func:`make_push` / :func:`make_pull`
for sockets (sync ``zmq.Context`` or ``zmq.asyncio.Context`` alike), :func:`send_msg` /
:func:`recv_msg` for sync sockets. Nothing is ever unpickled: bytes go through msgspec only.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import tempfile
import uuid

import zmq

from runtime.messages import (  # noqa: F401  (re-exported)
    ControlMsg, ErrorMsg, FreedSlotMsg, HeartbeatMsg, LogprobArrays, Message, NdArray, NewRequestMsg, ReadyMsg, ResultMsg,
    StepMsg, TransportError, decode, encode, from_scheduler_output, from_step_result,
    to_scheduler_output, to_step_result,
)

_IPC_MAX_PATH = 100  # Linux sun_path holds 107 bytes; keep a margin
_ipc_dir: str | None = None


def _private_dir() -> str:
    """One 0700 temp dir per process for ipc sockets, removed at exit by the creating process."""
    global _ipc_dir
    if _ipc_dir is None or not os.path.isdir(_ipc_dir):
        base = tempfile.gettempdir()
        if len(base) > 40:  # a long $TMPDIR would overflow sun_path
            base = "/tmp"
        _ipc_dir = tempfile.mkdtemp(prefix="ppstate-", dir=base)
        owner, path = os.getpid(), _ipc_dir
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    return _ipc_dir


def ipc_address(tag: str) -> str:
    """A fresh ``ipc://`` endpoint in a private temp dir, e.g. ``ipc:///tmp/ppstate-x/res-1a2b.sock``.

    ``tag`` is sanitised to ``[A-Za-z0-9_-]`` and shortened to fit the socket path limit. Where
    zmq lacks ipc (e.g. Windows), returns :func:`tcp_address` instead.
    """
    if not zmq.has("ipc"):
        return tcp_address()
    d = _private_dir()
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", tag)
    room = max(_IPC_MAX_PATH - len(d) - len("/-12345678.sock"), 0)
    return f"ipc://{d}/{safe[:room]}-{uuid.uuid4().hex[:8]}.sock"


def tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:port`` with a port free right now (another process may take it before the
    bind; to avoid that race bind ``tcp://127.0.0.1:*`` and read :func:`bound_endpoint`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint ``sock`` last bound (resolves a ``*`` port to the real one)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _make(ctx: zmq.Context, kind: int, addr: str, bind: bool, linger_ms: int, hwm: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    try:
        sock.bind(addr) if bind else sock.connect(addr)
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError(f"cannot {'bind' if bind else 'connect'} {addr}: {e}") from e
    return sock


def make_push(ctx: zmq.Context, addr: str, bind: bool, *, linger_ms: int = 1000,
              hwm: int = 0) -> zmq.Socket:
    """A PUSH socket bound to / connected to ``addr``.

    Args:
        ctx: ``zmq.Context`` or ``zmq.asyncio.Context`` (the socket is of the same flavour).
        linger_ms: how long ``close()`` keeps unsent messages (e.g. a final ErrorMsg).
        hwm: send high-water mark in messages; 0 = unbounded (steps are never dropped).

    Raises:
        TransportError: bind/connect failed (address in use, bad endpoint, path too long).
    """
    return _make(ctx, zmq.PUSH, addr, bind, linger_ms, hwm)


def make_pull(ctx: zmq.Context, addr: str, bind: bool, *, linger_ms: int = 0,
              hwm: int = 0) -> zmq.Socket:
    """A PULL socket bound to / connected to ``addr`` (arguments as :func:`make_push`)."""
    return _make(ctx, zmq.PULL, addr, bind, linger_ms, hwm)


def send_msg(sock: zmq.Socket, msg: Message) -> None:
    """Encode and send ``msg`` on a sync socket (blocks while the peer's queue is full)."""
    sock.send(encode(msg), copy=False)


def recv_msg(sock: zmq.Socket, timeout_s: float | None = None) -> Message | None:
    """Next message from a sync socket; ``None`` if ``timeout_s`` passes first.

    Raises:
        TransportError: the bytes are not a message.
    """
    if timeout_s is not None and not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
        return None
    return decode(sock.recv(copy=False).buffer)
