"""benchmarks/spec_serve_check.py: both servers of the comparison serve the same CPU kernel path."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("spec_serve_check",
                                              ROOT / "benchmarks" / "spec_serve_check.py")
ssc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ssc)


def _args(*extra):
    return ssc.build_parser().parse_args(["--model", "M", *extra])


def test_cpu_servers_both_get_the_exact_path():
    args = _args("--device", "cpu")
    off, on = ssc.server_command(args, 0, 9000), ssc.server_command(args, 4, 9004)
    assert off[off.index("--cpu-path") + 1] == on[on.index("--cpu-path") + 1] == "exact"
    assert off[off.index("--spec-tokens") + 1] == "0" and on[on.index("--spec-tokens") + 1] == "4"
    assert ssc.server_command(_args("--device", "cpu", "--cpu-path", "fast"), 0, 1)[-2:] == \
        ["--cpu-path", "fast"]


def test_cuda_servers_get_no_cpu_path_flag():
    assert "--cpu-path" not in ssc.server_command(_args("--device", "cuda"), 4, 9004)


def test_served_path_reads_the_startup_line(tmp_path):
    log = tmp_path / "k0.log"
    log.write_text("loading ...\nCPU path: exact (fp32 torch reference; reason: --spec-tokens 4)\n"
                   "ready: http://127.0.0.1:1\n")
    assert ssc.served_path(log) == "exact (fp32 torch reference; reason: --spec-tokens 4)"
    log.write_text("ready: http://127.0.0.1:1\n")
    assert ssc.served_path(log) is None


def test_both_servers_get_the_same_stage_count():
    args = _args("--device", "cuda", "--pp", "2")
    off, on = ssc.server_command(args, 0, 9000), ssc.server_command(args, 4, 9004)
    assert off[off.index("--pp") + 1] == on[on.index("--pp") + 1] == "2"
    one = ssc.server_command(_args("--device", "cuda"), 4, 9004)
    assert one[one.index("--pp") + 1] == "1"
