"""Per-seed simulator outputs of a fixed set of configurations, for byte-for-byte comparison of
two checkouts (issue #33: runs without speculation must not change).

    PYTHONPATH=/work/main python benchmarks/sim_identity.py /tmp/a
    PYTHONPATH=/work/wt/spec python benchmarks/sim_identity.py /tmp/b
    python benchmarks/sim_identity.py --compare /tmp/a /tmp/b

For each configuration and seed it writes three files: the CLI's JSON summary
(``python -m ppstate.sim ... --json``, without the trace path), the recorded trace's
``engine.jsonl`` (every scheduler event) and its ``header.json`` without the run id and creation
time. ``--compare`` prints how many files are identical and lists those that differ (exit 1).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

#: CLI flags of the configurations compared (each run for every seed of SEEDS)
CONFIGS = {
    "pp2-overlapped": "--pp 2 --requests 12",
    "pp3-sync-aborts": "--pp 3 --mode sync --requests 12 --abort-rate 0.3 --arrival poisson",
    "pp4-chunked-tight-kv": "--pp 4 --requests 16 --chunk 8 --max-num-seqs 4 --block-size 4 "
                            "--kv-blocks 40 --shared-prefix 8",
    "pp3-lanes-forks": "--pp 3 --requests 16 --adaptive-lanes --fork-rate 0.3 --contention 1.3",
    "pp2-no-prefix-cache": "--pp 2 --requests 10 --no-prefix-caching --p2p-ticks 1 "
                           "--broadcast-ticks 2",
}
SEEDS = range(6)


def write(out: Path) -> int:
    """Run every configuration and seed; write the files under ``out``. Returns the file count."""
    from ppstate.sim.cli import run_cli
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, flags in CONFIGS.items():
        for seed in SEEDS:
            with tempfile.TemporaryDirectory() as tmp:
                buf = io.StringIO()
                with contextlib.redirect_stdout(buf):
                    run_cli(flags.split() + ["--seed", str(seed), "--json", "--trace-dir", tmp])
                summary = json.loads(buf.getvalue())
                summary.pop("trace")
                stem = f"{name}-seed{seed}"
                (out / f"{stem}.summary.json").write_text(json.dumps(summary, sort_keys=True))
                run = next(Path(tmp).iterdir())
                (out / f"{stem}.engine.jsonl").write_bytes((run / "engine.jsonl").read_bytes())
                header = json.loads((run / "header.json").read_text())
                for volatile in ("run_id", "created_unix_s"):
                    header.pop(volatile, None)
                if header.get("repro"):   # the command line names the temporary trace dir
                    header["repro"] = header["repro"].replace(tmp, "TRACE_DIR")
                (out / f"{stem}.header.json").write_text(json.dumps(header, sort_keys=True))
                count += 3
    return count


def compare(a: Path, b: Path) -> int:
    """Print the count of identical files of ``a`` and ``b``; 1 if any differs or is missing."""
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    differ = [n for n in names if not (a / n).exists() or not (b / n).exists()
              or (a / n).read_bytes() != (b / n).read_bytes()]
    print(json.dumps({"files": len(names), "identical": len(names) - len(differ),
                      "differ": differ}))
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compare"]:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    print(write(Path(sys.argv[1])), "files written")
