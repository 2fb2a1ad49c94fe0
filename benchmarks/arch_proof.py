"""Behaviour-unchanged proof for restructurings (issue #28): run the tools, write comparable files.

Usage::

    python benchmarks/arch_proof.py OUT_DIR          # write the outputs
    diff -r REF_DIR OUT_DIR                          # compare two trees

It runs, each in a subprocess of the current interpreter from the current directory (so the
checkout on ``PYTHONPATH`` is the one measured):

* the simulator, 6 configurations x seeds 0, 1, 7, 42, each writing its ``--json`` summary and
  its trace (``sim/<config>-s<seed>.json`` and ``sim/<config>-s<seed>/``);
* the model checker at the small bounds of docs/checker.md (B0 at pp 2/3/4, B1 at pp 2/3; plus
  adaptive lanes, async issuing and the grammar + speculative bound): ``check/<name>.json``;
* three mutants, each with its counterexample trace (``mutant/<name>.json`` and ``mutant/<name>/``)
  and the replayer's verdict on that trace (``mutant/<name>.replay.txt``).

Fields that differ between two runs of the same code are removed before writing: wall and CPU
seconds, peak RSS, the run directory's path and id, its creation time. Everything else
(summaries, every trace event, state and transition counts) is kept, so ``diff -r`` of two
output trees reports any change of behaviour. Errors: a tool exiting with an unexpected status
raises ``RuntimeError`` naming the command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SEEDS = (0, 1, 7, 42)

SIM_CONFIGS: dict[str, list[str]] = {
    "pp2-overlapped": ["--pp", "2", "--requests", "24"],
    "pp3-sync": ["--pp", "3", "--requests", "24", "--mode", "sync", "--chunk", "8"],
    "pp4-aborts-poisson": ["--pp", "4", "--requests", "32", "--abort-rate", "0.1",
                           "--arrival", "poisson", "--max-num-seqs", "8"],
    "pp2-preempt-prefix": ["--pp", "2", "--requests", "24", "--kv-blocks", "24",
                           "--block-size", "4", "--shared-prefix", "8", "--fork-rate", "0.2"],
    "pp3-adaptive": ["--pp", "3", "--requests", "24", "--adaptive-lanes",
                     "--p2p-ticks", "1", "--broadcast-ticks", "1"],
    "pp2-small-chunk-eos": ["--pp", "2", "--requests", "24", "--chunk", "4",
                            "--max-num-batched-tokens", "16", "--eos-prob", "0.6",
                            "--contention", "1.5"],
}

B0 = ["--requests", "2", "--prompt-len", "1:1", "--max-tokens", "1:2"]
B1 = ["--requests", "2", "--prompt-len", "1:2", "--max-tokens", "1:2"]
CHECK_RUNS: dict[str, list[str]] = {
    "B0-pp2": ["--pp", "2", *B0, "--abort-anywhere"],
    "B0-pp3": ["--pp", "3", *B0, "--abort-anywhere"],
    "B0-pp4": ["--pp", "4", *B0, "--abort-anywhere"],
    "B1-pp2": ["--pp", "2", *B1, "--abort-anywhere"],
    "B1-pp3": ["--pp", "3", *B1, "--abort-anywhere"],
    "B0-pp2-adaptive": ["--pp", "2", *B0, "--abort-anywhere", "--adaptive-lanes"],
    "B0-pp2-async": ["--pp", "2", *B0, "--abort-anywhere", "--async"],
    "grammar-spec": ["--pp", "2", "--requests", "2", "--prompt-len", "1:2", "--max-tokens",
                     "2:2", "--spec-tokens", "1", "--grammar", "--abort-anywhere",
                     "--kv-blocks", "3"],
}

MUTANTS: dict[str, list[str]] = {
    "short_cadence": ["--pp", "2", *B0],
    "rank_local_skip": ["--pp", "2", *B1, "--abort-anywhere"],
    "no_generation_check": ["--pp", "2", *B1, "--abort-anywhere"],
}

VOLATILE = {"seconds", "cpu_seconds", "peak_rss_mb", "peak_worker_rss_mb", "trace",
            "counterexample", "created_unix_s", "run_id"}


def _scrub(obj):
    """Drop the run-to-run volatile keys of a JSON value, recursively."""
    if isinstance(obj, dict):
        return {k: _scrub(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    return obj


def _run(args: list[str], ok=(0,)) -> str:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def _copy_run(tmp: Path, dest: Path) -> None:
    """Move the one run-* directory under ``tmp`` to ``dest``, scrubbing header.json."""
    runs = sorted(tmp.glob("run-*"))
    if len(runs) != 1:
        raise RuntimeError(f"expected one run directory under {tmp}, found {len(runs)}")
    shutil.copytree(runs[0], dest)
    header = dest / "header.json"
    if header.exists():  # fixed id and time: the replayer still reads the header
        data = json.loads(header.read_text())
        data.update(run_id="run-fixed", created_unix_s=0.0)
        if data.get("repro"):   # the simulator's command line names the temporary trace dir
            data["repro"] = data["repro"].replace(str(tmp), "TRACE_DIR")
        header.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def _write_json(path: Path, text: str) -> None:
    path.write_text(json.dumps(_scrub(json.loads(text)), indent=1, sort_keys=True) + "\n")


def main(out: Path) -> int:
    """Write every output under ``out`` (created; must not exist). Returns the file count."""
    out.mkdir(parents=True)
    for sub in ("sim", "check", "mutant"):
        (out / sub).mkdir()
    for name, args in SIM_CONFIGS.items():
        for seed in SEEDS:
            with tempfile.TemporaryDirectory() as tmp:
                text = _run(["-m", "ppstate.sim", *args, "--seed", str(seed), "--json",
                             "--trace-dir", tmp])
                _write_json(out / "sim" / f"{name}-s{seed}.json", text)
                _copy_run(Path(tmp), out / "sim" / f"{name}-s{seed}")
    for name, args in CHECK_RUNS.items():
        _write_json(out / "check" / f"{name}.json",
                    _run(["-m", "ppstate.check", *args, "--json"]))
    for name, args in MUTANTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            text = _run(["-m", "ppstate.check", *args, "--mutant", name, "--json",
                         "--trace-dir", tmp], ok=(0, 1))
            _write_json(out / "mutant" / f"{name}.json", text)
            _copy_run(Path(tmp), out / "mutant" / name)
        proc = subprocess.run([sys.executable, "-m", "ppstate.replay", str(out / "mutant" / name)],
                              capture_output=True, text=True)
        verdict = (proc.stdout + proc.stderr).replace(str(out / "mutant" / name), "<run>")
        (out / "mutant" / f"{name}.replay.txt").write_text(f"exit {proc.returncode}\n{verdict}")
    return sum(1 for p in out.rglob("*") if p.is_file())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    count = main(Path(sys.argv[1]))
    print(f"{count} files under {sys.argv[1]} ({os.getcwd()})")
