"""Security defaults of issue #12 item 6 (the API key and the body limit are exercised in
test_server_api.py / test_server_validation.py): loopback bind, local-only worker transport,
nothing unpickled from a socket."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest

from runtime import transport as tp
from runtime.config import EngineConfig
from runtime.engine.launcher import WorkerPool
from runtime.engine.plan import plan_pipeline
from runtime.serve import parse_cli

ROOT = Path(__file__).resolve().parents[2]


def test_server_binds_loopback_unless_told():
    args, _ = parse_cli([])
    assert args.host == "127.0.0.1"
    assert parse_cli(["--host", "0.0.0.0"])[0].host == "0.0.0.0"


def test_spawned_workers_talk_over_private_ipc_and_loopback():
    config = EngineConfig(pp_size=2)
    pool = WorkerPool(config, plan_pipeline(config))
    result, steps, rendezvous = pool._addresses()
    for addr in [result, *steps]:
        assert addr.startswith("ipc://")
        d = os.path.dirname(addr[len("ipc://"):])
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert rendezvous.startswith("tcp://127.0.0.1:")


def test_torchrun_is_the_only_launcher_listening_beyond_loopback():
    config = EngineConfig(pp_size=2, launcher="torchrun", engine_port=29700)
    pool = WorkerPool(config, plan_pipeline(config))
    result, steps, rendezvous = pool._addresses()
    assert result == "tcp://*:29700" and rendezvous == "env://"  # multi-node: the user's choice


@pytest.mark.parametrize("payload", [pickle.dumps({"type": "step"}), pickle.dumps(os.system)])
def test_a_pickle_on_the_socket_is_rejected_not_loaded(payload):
    with pytest.raises(tp.TransportError, match="malformed message"):
        tp.decode(payload)


def test_no_pickle_in_the_socket_code():
    files = ["runtime/transport.py", "runtime/messages.py", "runtime/engine/launcher.py", "runtime/engine/plan.py",
             "runtime/worker/main.py", "runtime/worker/heartbeat.py", "runtime/engine/async_engine.py",
             "runtime/engine/torchrun.py"]
    for f in files:
        text = (ROOT / f).read_text()
        for bad in ("import pickle", "pickle.load", "cloudpickle", "recv_pyobj", "send_pyobj",
                    "recv_serialized", "torch.load"):
            assert bad not in text, (f, bad)


def test_heartbeat_round_trip():
    beat = tp.HeartbeatMsg(rank=1, step=41, in_step_s=0.25, phase="recv", in_phase_s=0.125,
                           steps_done=40)
    back = tp.decode(tp.encode(beat))
    assert (back.kind, back.rank, back.step, back.in_step_s) == ("heartbeat", 1, 41, 0.25)
    assert (back.phase, back.in_phase_s, back.steps_done) == ("recv", 0.125, 40)
