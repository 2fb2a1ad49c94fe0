"""``python -m runtime.serve`` flags: --help, flag -> EngineConfig, errors naming the flag, busy port.

None of these start an engine: flag errors and a busy port must fail before the model loads.
"""

from __future__ import annotations

import socket

import pytest

from runtime import serve


def parse(*argv: str):
    return serve.parse_cli(list(argv))


def test_defaults():
    args, cfg = parse()
    assert (args.host, args.port, args.api_key, args.max_body_bytes) == ("127.0.0.1", 8000, None, 1 << 20)
    # issue #30: keep-alive past clients' 5 s pool expiry; no drain and one process unless asked
    assert (args.timeout_keep_alive, args.shutdown_timeout, args.api_server_count) == (75.0, 0.0, 0)
    assert (cfg.model, cfg.scheduler.pp_size, cfg.scheduler.mode, cfg.trace_dir) == ("default", 2, "overlapped", None)


def test_flags_map_to_config():
    args, cfg = parse("--model", "/models/llama", "--pp", "4", "--host", "0.0.0.0", "--port", "9001",
                      "--max-num-seqs", "16", "--max-model-len", "1024", "--max-prefill-chunk", "64",
                      "--pp-schedule", "sync", "--api-key", "sk-x", "--trace-dir", "/tmp/tr")
    assert (args.host, args.port, args.api_key) == ("0.0.0.0", 9001, "sk-x")
    assert (cfg.model, cfg.scheduler.pp_size, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len, cfg.scheduler.max_prefill_chunk,
            cfg.scheduler.mode, cfg.trace_dir) == ("/models/llama", 4, 16, 1024, 64, "sync", "/tmp/tr")


@pytest.mark.parametrize("argv, flag", [
    (["--pp", "0"], "--pp"),
    (["--max-model-len", "3"], "--max-model-len"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--pp-schedule", "fast"], "--pp-schedule"),
    (["--port", "70000"], "--port"),
    (["--port", "eighty"], "--port"),
    (["--max-body-bytes", "10"], "--max-body-bytes"),
    (["--max-restarts", "-1"], "--max-restarts"),
    (["--restart-backoff", "-2"], "--restart-backoff"),
    (["--stall-timeout", "-1"], "--stall-timeout"),
    (["--timeout-keep-alive", "0"], "--timeout-keep-alive"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--api-server-count", "-1"], "--api-server-count"),
    (["--api-server-count", "2", "--dp", "2"], "--api-server-count"),
])
def test_bad_flag_names_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}" in err or f"error: {flag}:" in err, err


def test_restart_and_stall_flags():
    args, cfg = parse()
    assert (args.restart_workers, args.max_restarts, args.restart_backoff) == (False, 3, 1.0)
    assert cfg.stall_timeout_s == 8.0
    args, cfg = parse("--restart-workers", "--max-restarts", "5", "--restart-backoff", "0.5",
                      "--stall-timeout", "0")
    assert (args.restart_workers, args.max_restarts, args.restart_backoff) == (True, 5, 0.5)
    assert cfg.stall_timeout_s == 0.0


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("PPSTATE_API_KEY", "sk-env")
    assert parse()[0].api_key == "sk-env"
    assert parse("--api-key", "sk-flag")[0].api_key == "sk-flag"


def test_busy_port_fails_before_loading(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert serve.main(["--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on 127.0.0.1:{port}: ")


def test_help_lists_the_flags(monkeypatch, capsys):
    """``--help`` through ``serve.main`` in process (the module entry point itself runs in
    test_server_e2e.py); 80 columns, as argparse wraps for a pipe."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        serve.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--pp ", "--host", "--port", "--max-num-seqs", "--max-model-len",
                 "--max-prefill-chunk", "--pp-schedule", "--api-key", "--trace-dir"):
        assert flag in out, flag
    assert "(default: 127.0.0.1)" in out and "(default: 8000)" in out


def test_url_of_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert serve.url_of(s, "127.0.0.1") == f"http://127.0.0.1:{s.getsockname()[1]}"


def test_adaptive_lanes_default_on_the_fast_cpu_path_only():
    assert parse("--device", "cpu")[1].scheduler.adaptive_lanes is True
    assert parse("--device", "cpu", "--no-adaptive-lanes")[1].scheduler.adaptive_lanes is False
    assert parse("--device", "cpu", "--cpu-path", "exact")[1].scheduler.adaptive_lanes is False
    assert parse("--device", "cpu", "--cpu-path", "exact", "--adaptive-lanes")[1].scheduler.adaptive_lanes is True
    assert parse("--device", "cpu", "--spec-tokens", "2")[1].scheduler.adaptive_lanes is False
