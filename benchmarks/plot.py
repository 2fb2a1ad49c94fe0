"""Plot the PP benchmark results: decode throughput per mode by concurrency, and long-prompt
TTFT per mode (``python benchmarks/plot.py [--out benchmarks/results/pp.png]``).

Reads the newest ``benchmarks/results/*.json`` of kind ``pp`` holding a sweep and the newest
holding the prefill workload (``python -m runtime.bench pp ... --json-out``); matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_table import RESULTS, load_results  # noqa: E402


def plot(out: Path, folder: Path = RESULTS) -> Path:
    """Write the PNG to ``out``; returns it.

    Raises:
        ValueError: no pp result with a sweep or with the prefill workload.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    docs = [d for _, d in load_results(folder) if d["kind"] == "pp"]
    sweep = next((d for d in reversed(docs) if d["results"].get("sweep")), None)
    prefill = next((d for d in reversed(docs) if d["results"].get("prefill")), None)
    if sweep is None or prefill is None:
        raise ValueError(f"{folder} needs a pp result with --sweep and one with the prefill workload")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    pts = sweep["results"]["sweep"]["points"]
    modes = [k[: -len("_output_tokens_per_s")] for k in pts[0] if k.endswith("_output_tokens_per_s")]
    xs = [p["concurrency"] for p in pts]
    for m in modes:
        ax1.plot(xs, [p[m + "_output_tokens_per_s"] for p in pts], marker="o", label=m)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"decode throughput, PP={sweep['results']['pp_size']}")
    ax1.legend()
    ax1.grid(alpha=0.3)
    pre = prefill["results"]["prefill"]
    names = [k for k in pre["runs"]]
    ttft = [sorted(r["max_ttft_s"] for r in pre["runs"][k])[len(pre["runs"][k]) // 2] for k in names]
    ax2.bar(range(len(names)), ttft, color=["tab:gray", "tab:blue", "tab:green"][: len(names)])
    ax2.set_xticks(range(len(names)), names, rotation=10)
    ax2.set_ylabel("TTFT (s), median of rounds")
    ax2.set_title(f"long prompt ({prefill['args']['prefill_len']} tokens) TTFT")
    fig.suptitle(sweep["machine"][:110], fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(RESULTS / "pp.png"))
    args = p.parse_args(argv)
    print(f"wrote {plot(Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
