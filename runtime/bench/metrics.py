"""Serving-benchmark metrics from per-request timestamps (pure: no I/O, no clock).

Definitions follow ``vllm bench serve`` (vllm/benchmarks/serve.py): TTFT = first token time -
send time; ITL = gaps between consecutive token arrivals of one request (a chunk carrying k tokens
counts as one arrival); TPOT = (E2E - TTFT) / (output tokens - 1) per request with > 1 token;
E2E = last arrival - send time. Throughputs divide by the benchmark's wall time. Percentiles use
linear interpolation between closest ranks (numpy's default ``linear`` method).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request's measurement (seconds on one monotonic clock).

    Attributes:
        sent_s: time the request was sent.
        chunk_s: arrival time of every streamed chunk that carried output tokens, in order.
        prompt_tokens: prompt length (tokens).
        output_tokens: tokens generated (from the usage block; the chunk count when absent).
        ok: False when the request failed (``error`` says why); failed requests count in
            ``failed`` only.
    """
    sent_s: float
    chunk_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    ok: bool = True
    error: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.chunk_s[-1] - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values`` with linear interpolation; 0.0 when empty.

    Raises:
        ValueError: p outside [0, 100].
    """
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    return float(np.percentile(np.asarray(values, dtype=float), p)) if values else 0.0


def stats(values: list[float], prefix: str) -> dict[str, float]:
    """``{prefix_mean_ms, prefix_median_ms, prefix_p90_ms, prefix_p99_ms}`` of seconds ``values``."""
    out = {f"{prefix}_mean_ms": 1000.0 * float(np.mean(values)) if values else 0.0}
    for p in PERCENTILES:
        name = "median" if p == 50 else f"p{p}"
        out[f"{prefix}_{name}_ms"] = 1000.0 * percentile(values, p)
    return out


def summarize(records: list[RequestRecord], wall_s: float) -> dict[str, float | int]:
    """Benchmark figures of ``records`` run in ``wall_s`` seconds: completed / failed counts,
    request throughput (req/s), output and total token throughput (tokens/s) and TTFT, TPOT,
    ITL and E2E statistics in milliseconds (mean, median, p90, p99).

    Raises:
        ValueError: wall_s <= 0.
    """
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    done = [r for r in records if r.ok and r.chunk_s]
    out_tok = sum(r.output_tokens for r in done)
    in_tok = sum(r.prompt_tokens for r in done)
    res: dict[str, float | int] = {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": wall_s,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(done) / wall_s, "output_throughput": out_tok / wall_s,
        "total_token_throughput": (in_tok + out_tok) / wall_s}
    res.update(stats([r.ttft_s for r in done], "ttft"))
    res.update(stats([t for r in done if (t := r.tpot_s) is not None], "tpot"))
    res.update(stats([g for r in done for g in r.itl_s], "itl"))
    res.update(stats([r.e2e_s for r in done], "e2e"))
    return res
