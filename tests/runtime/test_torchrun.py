"""The torchrun launcher: flag resolution, remote-rank worker arguments, the worker's idle exit,
and a real ``torchrun --nproc-per-node 2 -m runtime.generate`` matching the transformers reference."""

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
from runtime.engine.torchrun import (
    WORKER_IDLE_EXIT_S, TorchrunEnv, remote_worker_args, resolve_cli, run_remote_rank,
)
from runtime.worker.main import _Worker
from reference import greedy_reference, hf_model

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"
PROMPT = "The capital of France is"
NEW_TOKENS = 8


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
    assert (cfg.launcher, cfg.scheduler.pp_size, cfg.engine_port, args.pp) == ("torchrun", 3, 31000, 3)
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
    """The worker keeps serving while pings arrive and returns once they stop: it consumed every
    ping, and returned only after the last one was sent (ordering of events, no time window)."""
    ctx = zmq.Context()
    addr = tp.ipc_address("idle")
    push = tp.make_push(ctx, addr, bind=True, linger_ms=0)
    pull = tp.make_pull(ctx, addr, bind=False)
    args = SimpleNamespace(config=EngineConfig().model_dump(), rank=1, idle_exit_s=2.0)
    sent: list[int] = []

    def pinger() -> None:  # 10 pings, spaced well inside the idle window
        for i in range(10):
            push.send(tp.encode(tp.ControlMsg(kind="ping")))
            sent.append(i)
            time.sleep(0.05)

    t = threading.Thread(target=pinger)
    t.start()
    _Worker(args, push=None).serve(pull)
    sent_when_returned = len(sent)
    t.join()
    with pytest.raises(zmq.Again):   # nothing left unread: every ping reached the worker
        pull.recv(zmq.NOBLOCK)
    push.close(0)
    pull.close(0)
    ctx.term()
    assert sent_when_returned == 10


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid
    except (ProcessLookupError, PermissionError):
        return False


def test_torchrun_generate_matches_transformers():
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
    _, hf_tok = hf_model()
    prompt_ids = hf_tok(PROMPT)["input_ids"]
    want = greedy_reference(tuple(prompt_ids), NEW_TOKENS)
    assert res["prompt_token_ids"] == prompt_ids
    assert res["token_ids"] == list(want)
    assert (res["text"], res["finish_reason"]) == (hf_tok.decode(list(want)), "length")
    left = [p for p in psutil.process_iter() if _in_session(p, proc.pid)]
    _, alive = psutil.wait_procs(left, timeout=60)  # hang guard: they exit with torchrun
    assert alive == []  # every rank and helper process exited
