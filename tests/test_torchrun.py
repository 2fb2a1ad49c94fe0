"""The torchrun launcher: flag resolution, remote-rank worker arguments, the worker's idle exit,
and a real ``torchrun --nproc-per-node 2 -m runtime.generate`` matching spawn mode's tokens."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import zmq

from runtime import transport as tp
from runtime.cli_common import add_engine_flags, engine_config
from runtime.config import EngineConfig
from runtime.torchrun import (
    WORKER_IDLE_EXIT_S, TorchrunEnv, remote_worker_args, resolve_cli, run_remote_rank,
)
from runtime.worker.main import _Worker

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
PROMPT = "The capital of France is"
#: greedy ids of PROMPT, 8 new tokens, default model (same from `python -m runtime.generate --pp 2`)
SPAWN_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42]


def tr_env(rank: int = 0, world: int = 2, addr: str = "10.0.0.5") -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": addr,
            "MASTER_PORT": "29500", "LOCAL_RANK": str(rank)}


def test_env_needs_every_variable():
    assert TorchrunEnv.from_environ({}) is None
    partial = {k: v for k, v in tr_env().items() if k != "LOCAL_RANK"}
    assert TorchrunEnv.from_environ(partial) is None
    assert TorchrunEnv.from_environ(tr_env(1, 4)) == TorchrunEnv(1, 4, "10.0.0.5", 29500, 1)
    with pytest.raises(ValueError, match="^--launcher: bad torchrun environment variable"):
        TorchrunEnv.from_environ({**tr_env(), "RANK": "x"})


def test_engine_addr_brackets_ipv6():
    assert TorchrunEnv(0, 2, "10.0.0.5", 1, 0).engine_addr(29600) == "tcp://10.0.0.5:29600"
    assert TorchrunEnv(0, 2, "fd00::1", 1, 0).engine_addr(29601) == "tcp://[fd00::1]:29601"


def test_resolve_auto_and_pp_default():
    assert resolve_cli({"launcher": "auto", "pp_size": None}, {}) == {"launcher": "spawn", "pp_size": 2}
    assert resolve_cli({"launcher": "auto", "pp_size": None}, tr_env(0, 3)) == {
        "launcher": "torchrun", "pp_size": 3}
    assert resolve_cli({"launcher": "spawn", "pp_size": 4}, tr_env(0, 3)) == {
        "launcher": "spawn", "pp_size": 4}


def test_resolve_errors_name_the_flag():
    with pytest.raises(ValueError) as e:
        resolve_cli({"launcher": "auto", "pp_size": 3}, tr_env(0, 2))
    assert str(e.value) == ("--pp: must equal torchrun's WORLD_SIZE=2 (one process per pipeline "
                            "stage), got 3; drop --pp to use WORLD_SIZE")
    with pytest.raises(ValueError, match="^--launcher: torchrun needs the variables RANK, "):
        resolve_cli({"launcher": "torchrun", "pp_size": 2}, {})


def test_engine_config_flags(monkeypatch, capsys):
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    for k, v in tr_env(0, 3).items():
        monkeypatch.setenv(k, v)
    args = p.parse_args(["--engine-port", "31000"])
    cfg = engine_config(p, args)
    assert (cfg.launcher, cfg.pp_size, cfg.engine_port, args.pp) == ("torchrun", 3, 31000, 3)
    with pytest.raises(SystemExit) as e:
        engine_config(p, p.parse_args(["--pp", "2"]))
    assert e.value.code == 2
    assert "error: --pp: must equal torchrun's WORLD_SIZE=3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        engine_config(p, p.parse_args(["--engine-port", "65500"]))
    assert "error: --engine-port: " in capsys.readouterr().err


def test_remote_worker_args_and_rank0_runs_the_engine():
    cfg = EngineConfig(launcher="torchrun", pp_size=2, engine_port=29610)
    args = remote_worker_args(cfg, TorchrunEnv.from_environ(tr_env(1, 2)))
    assert (args.rank, args.layer_range, args.init_method) == (1, (19, 30), "env://")
    assert (args.step_addr, args.result_addr) == ("tcp://10.0.0.5:29612", "tcp://10.0.0.5:29610")
    assert (args.idle_exit_s, EngineConfig(**args.config)) == (WORKER_IDLE_EXIT_S, cfg)
    assert run_remote_rank(cfg, tr_env(0, 2)) is None                        # rank 0: engine
    assert run_remote_rank(EngineConfig(pp_size=2), tr_env(1, 2)) is None   # spawn launcher
    assert run_remote_rank(cfg, {}) is None                                  # not under torchrun


def test_worker_exits_after_pings_stop():
    ctx = zmq.Context()
    addr = tp.ipc_address("idle")
    push = tp.make_push(ctx, addr, bind=True, linger_ms=0)
    pull = tp.make_pull(ctx, addr, bind=False)
    args = SimpleNamespace(config=EngineConfig().model_dump(), rank=1, idle_exit_s=0.4)
    sent: list[float] = []

    def pinger() -> None:  # 10 pings, 0.1 s apart
        for _ in range(10):
            push.send(tp.encode(tp.ControlMsg(kind="ping")))
            sent.append(time.monotonic())
            time.sleep(0.1)

    t = threading.Thread(target=pinger)
    t.start()
    _Worker(args, push=None).serve(pull)
    silent_s = time.monotonic() - sent[-1]  # exit came this long after the last ping
    t.join()
    push.close(0)
    pull.close(0)
    ctx.term()
    assert len(sent) == 10 and 0.4 <= silent_s < 2.0


def _session_procs(sid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) == sid:
                out.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, PermissionError):
            continue
    return out


def test_torchrun_generate_matches_spawn():
    port = int(tp.tcp_address().rsplit(":", 1)[1])
    if port > 65000:
        port = 29650
    cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "runtime.generate", "--prompt", PROMPT, "--max-tokens", "8", "--json",
           "--temperature", "0", "--engine-port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # only rank 0 prints
    res = json.loads(lines[0])
    assert res["token_ids"] == SPAWN_IDS
    assert res["prompt_token_ids"] == [504, 3575, 282, 4649, 314]
    assert (res["text"], res["finish_reason"]) == (" Paris.\n\nThe answer is:", "length")
    deadline = time.monotonic() + 10
    while _session_procs(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_procs(proc.pid) == []  # every rank and helper process exited
