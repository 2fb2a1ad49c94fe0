"""Markdown tables from a ``benchmarks/results/gpu-*.json`` file (README / docs/gpu.md)."""

from __future__ import annotations


def _f(x, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(res: dict) -> str:
    """The PP=1, prefill and PP=2 tables of one benchmark result (``python -m runtime.bench gpu``)."""
    lines = [f"GPU: {res.get('gpu')} ×{res.get('gpus')}, {res.get('date')}, torch {res.get('torch')}",
             "", "| model | batch | ppstate tok/s | step ms | roofline ms | host ms/step | eager tok/s | "
             "HF static tok/s | HF default tok/s | vs static | vs default |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("pp1", []):
        st, de = r.get("transformers_static_tokens_per_s"), r.get("transformers_default_tokens_per_s")
        tps = r["tokens_per_s"]
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {_f(tps)} | {_f(r.get('step_ms'), '{:.2f}')} | "
            f"{_f(r.get('roofline_step_ms'), '{:.2f}')} | {_f(r.get('host_issue_ms'), '{:.2f}')} | {_f(r.get('eager_tokens_per_s'))} | {_f(st)} | "
            f"{_f(de)} | {_f(tps / st if st else None, '{:.2f}x')} | "
            f"{_f(tps / de if de else None, '{:.1f}x')} |")
    lines += ["", "| model | prefill prompts x len | ppstate tok/s | HF forward tok/s |", "|---|---|---|---|"]
    for r in res.get("prefill", []):
        lines.append(f"| {r['model']} | {r['prompts']} x {r['prompt_len']} | {_f(r['tokens_per_s'])} | "
                     f"{_f(r.get('transformers_tokens_per_s'))} |")
    if res.get("pp2"):
        lines += ["", "| model | workload | PP=2 overlapped | PP=2 sync | ratio | TTFT sync/overlapped | "
                  "PP=1 tok/s | overlapped / PP=1 |", "|---|---|---|---|---|---|---|---|"]
        for r in res["pp2"]:
            o, p1 = r.get("overlapped_tokens_per_s"), r.get("pp1_tokens_per_s")
            work = r["workload"] + (f", {r['batch_size']} rows" if r.get("batch_size") else "") + \
                (f", chunk {r['chunk']}" if r.get("chunk") else "")
            lines.append(
                f"| {r['model']} | {work} | {_f(o)} | {_f(r.get('sync_tokens_per_s'))} | "
                f"{_f(r.get('throughput_ratio'), '{:.2f}')} | {_f(r.get('ttft_ratio'), '{:.2f}')} | "
                f"{_f(p1)} | {_f(o / p1 if o and p1 else None, '{:.2f}')} |")
    for shape, v in (res.get("validation") or {}).items():
        lines += ["", f"{shape}, batch {v['batch_size']}, per-slot state + mirrors every step: "
                  f"validation off {_f(v['off_tokens_per_s'])} tok/s, async {_f(v['async_tokens_per_s'])} "
                  f"(cost {100 * v['async_cost']:.1f}%), synchronous {_f(v['sync_tokens_per_s'])} "
                  f"(cost {100 * v['sync_cost']:.1f}%)."]
    for shape, c in (res.get("capture") or {}).items():
        mem = (f"{c['bytes'] / 2**20:.0f} MiB" if c["bytes"] >= 0 else
               "memory not measured (a negative figure: memory freed by an earlier model was "
               "released during capture; fixed since)")
        lines += [f"{shape}: {len(c['buckets'])} CUDA graphs captured in {c['seconds']:.1f} s, {mem}."]
    return "\n".join(lines)
