"""Step-cost model of one pipeline stage: seconds per step as a function of rows and tokens.

One stage's forward over a step of ``rows`` rows computing ``tokens`` tokens, where row ``i``'s
``n_i`` new tokens attend to ``p_i`` cached prefix tokens, is modelled as::

    t = base_s + per_row_s * rows + per_token_s * tokens + per_prefix_token_s * sum_i n_i * p_i

(fixed launch / framework / transport cost, per-row bookkeeping, the linear layers, and the
attention over the cached prefix). ``concurrency`` (>= 1) is the slow-down of a stage while every
stage computes at once (stages that share cores, caches or memory bandwidth; 1.0 on separate
devices). The linear-plus-prefix-attention form is the one SGLang fits for its dynamic chunk
sizing in chunked pipeline parallelism (SGLang blog, "Chunked Pipeline Parallelism", 2025).

Calibration: :func:`fit` solves the least-squares problem over timed steps.
``python -m runtime.bench contention`` times each stage's forward of the real model alone and
with all stages at once (decode steps of 1..64 rows, prefill chunks after several prefix lengths,
which separates the prefix-attention term) and fits the model to them, ``concurrency`` = the
measured slow-down; ``python -m runtime.bench pp --sweep ... --workload prefill --calibrate``
fits it to the ranks' busy seconds per step of engine runs instead. Both write the coefficients
under ``results.step_cost``; the engine loads that file (``--step-cost FILE``). The engine does
not time steps at startup, and ``concurrency`` is a constant: on a CPU shared with other work the
slow-down follows the machine's load (see docs/benchmarks.md), so calibrate under the load the
engine will see.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

#: Default coefficients: the fit of ``python -m runtime.bench pp --workload prefill --chunks
#: --sweep 1,2,4,8,16,32 --no-adaptive --repeats 2 --max-tokens 32 --prefill-len 1024 --calibrate``
#: on the shared 2-core CPU machine (SmolLM2-135M, PP=2, fp32, one torch thread per rank; load
#: average ~17 from other jobs; benchmarks/results/step-cost-cpu-2026-12-01.json), rounded.
#: Other machines: calibrate and pass the file with ``--step-cost``.
CPU_DEFAULTS = {"base_s": 0.25, "per_row_s": 0.00038, "per_token_s": 0.00038,
                "per_prefix_token_s": 8.8e-6, "concurrency": 1.15}


@dataclass(frozen=True)
class StepCostModel:
    """Seconds one stage spends on one step (see the module docstring for the formula).

    Attributes:
        base_s: seconds per step whatever its rows (>= 0).
        per_row_s: seconds per row (>= 0).
        per_token_s: seconds per computed token (>= 0).
        per_prefix_token_s: seconds per (new token x cached prefix token) pair (>= 0).
        concurrency: slow-down factor of a stage while all stages compute at once (>= 1).

    Raises:
        ValueError: a coefficient out of range (the message names it).
    """
    base_s: float = CPU_DEFAULTS["base_s"]
    per_row_s: float = CPU_DEFAULTS["per_row_s"]
    per_token_s: float = CPU_DEFAULTS["per_token_s"]
    per_prefix_token_s: float = CPU_DEFAULTS["per_prefix_token_s"]
    concurrency: float = CPU_DEFAULTS["concurrency"]

    def __post_init__(self) -> None:
        for name in ("base_s", "per_row_s", "per_token_s", "per_prefix_token_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"StepCostModel.{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.concurrency >= 1.0:
            raise ValueError(f"StepCostModel.concurrency must be >= 1, got {self.concurrency!r}")

    def step_s(self, rows: int, tokens: int, prefix_products: float = 0.0) -> float:
        """Seconds of one stage for a step of ``rows`` rows and ``tokens`` tokens;
        ``prefix_products`` = sum over rows of new tokens x cached prefix tokens."""
        return (self.base_s + self.per_row_s * rows + self.per_token_s * tokens
                + self.per_prefix_token_s * prefix_products)

    def chunk_s(self, num_tokens: int, prefix: int) -> float:
        """Seconds of one prefill chunk of ``num_tokens`` tokens after ``prefix`` cached tokens,
        without the per-step base cost (tokens attend to the prefix and, causally, to each other:
        n x (prefix + (n - 1) / 2) pairs)."""
        pairs = num_tokens * (prefix + (num_tokens - 1) / 2.0)
        return self.per_token_s * num_tokens + self.per_prefix_token_s * pairs

    def slowdown(self, lanes: int, pp_size: int) -> float:
        """Slow-down of a stage while ``lanes`` of the ``pp_size`` lanes carry work: 1 with one
        lane (the stages take turns), ``concurrency`` with all lanes (every stage computes), linear
        in between (``min(lanes, pp_size)`` stages compute at once; an interpolation, measured
        only at the two ends by ``python -m runtime.bench contention``)."""
        busy = max(1, min(lanes, pp_size))
        if pp_size <= 1 or busy == 1:
            return 1.0
        return 1.0 + (self.concurrency - 1.0) * (busy - 1) / (pp_size - 1)

    def decode_round_s(self, rows: int, lanes: int, pp_size: int) -> float:
        """Seconds until each of ``rows`` decoding requests got one more token when they are
        spread over ``lanes`` (1..pp_size) in-flight batches: a token needs its batch to pass all
        ``pp_size`` stages, each taking one step of ``ceil(rows / lanes)`` rows, slowed down by
        :meth:`slowdown` while several lanes compute at once. With fewer lanes than stages the
        pipeline runs partly empty, so the round is ``pp_size`` steps whatever ``lanes`` is;
        divided by ``rows`` it is the time per decoded token the lane policy minimises."""
        per_lane = -(-rows // lanes)
        return pp_size * self.step_s(per_lane, per_lane) * self.slowdown(lanes, pp_size)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepCostModel":
        """Build from a dict holding (at least) the five coefficients; other keys are ignored."""
        return cls(**{k: float(data[k]) for k in CPU_DEFAULTS if k in data})


def fit(samples: list[tuple[int, int, float, float]], concurrency: float = 1.0) -> StepCostModel:
    """Least-squares fit of the four step coefficients (negative ones clipped to 0 and refitted).

    Args:
        samples: ``(rows, tokens, prefix_products, seconds)`` of timed single-stage steps
            (at least 4 with distinct shapes).
        concurrency: the measured slow-down with all stages busy (kept as given).

    Raises:
        ValueError: fewer than 4 samples.
    """
    if len(samples) < 4:
        raise ValueError(f"fit needs at least 4 timed steps, got {len(samples)}")
    x = np.array([[1.0, r, t, p] for r, t, p, _ in samples])   # [num_samples, 4]
    y = np.array([s for *_, s in samples])                       # [num_samples]
    keep = np.ones(4, dtype=bool)
    coef = np.zeros(4)
    for _ in range(4):  # non-negative least squares by dropping negative terms (4 terms at most)
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        coef[:] = 0.0
        coef[keep] = sol
        if (coef >= 0).all():
            break
        keep &= coef > 0
    return StepCostModel(*(max(0.0, float(c)) for c in coef), concurrency=max(1.0, concurrency))


def model_of(config) -> StepCostModel:
    """The step-cost model held by a :class:`~ppstate.budget.SchedulerConfig` (its ``cost_*``
    fields); cached on the frozen config."""
    cached = config.__dict__.get("_cost_model")
    if cached is None:
        cached = StepCostModel(config.cost_base_s, config.cost_per_row_s, config.cost_per_token_s,
                               config.cost_per_prefix_token_s, config.cost_concurrency)
        object.__setattr__(config, "_cost_model", cached)
    return cached
