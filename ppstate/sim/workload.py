"""Simulator configuration and seeded workload (the token "model" is :mod:`ppstate.oracle.model`).

Everything random in a simulation comes from one ``numpy.random.default_rng(seed)`` drawn here, in
a fixed order, so a (config, seed) pair reproduces a run exactly. Times are integer logical ticks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ppstate.budget import SchedulerConfig
from ppstate.errors import SchedulerError
from ppstate.oracle.model import FIRST_TOKEN, VOCAB, SimRequest

#: the scheduler defaults of a simulation where they differ from :class:`SchedulerConfig`'s own
SIM_SCHEDULER_DEFAULTS = {"max_prefill_chunk": 32}
#: names of the scheduler's fields, which :class:`SimConfig` also takes flat
SCHEDULER_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig))


@dataclass(frozen=True, init=False)
class SimConfig:
    """Simulation parameters (CLI flags in brackets).

    The scheduler's budgets and KV-cache geometry are :attr:`scheduler`, a
    :class:`ppstate.budget.SchedulerConfig` (declared once there). They may be given flat
    (``SimConfig(pp_size=3, max_prefill_chunk=8)``) or as ``scheduler=`` (a SchedulerConfig or a
    dict of its fields); flat fields override ``scheduler``'s, unset ones take
    :data:`SIM_SCHEDULER_DEFAULTS`, then the scheduler's defaults.

    Attributes:
        scheduler: pp_size [--pp], mode [--mode], max_prefill_chunk [--max-prefill-chunk, alias
            --chunk], max_num_seqs, max_num_batched_tokens, max_model_len, block_size,
            num_kv_blocks [--kv-blocks (default: room for max_model_len per slot)],
            enable_prefix_caching [--no-prefix-caching]; few KV blocks force preemptions.
        num_requests [--requests], seed [--seed].
        prompt_len, output_len: inclusive (low, high) ranges in tokens [--prompt-len A:B, --output-len].
        abort_rate: probability a request is aborted at a random tick [--abort-rate].
        arrival: "burst" (all at tick 0) or "poisson" (mean gap ``mean_gap`` ticks) [--arrival].
        eos_prob: probability a request's model emits EOS before max_tokens [--eos-prob].
        stage_base, stage_per_token: stage time of a batch = base + per_token * tokens (ticks)
            [--stage-cost BASE:PER_TOKEN].
        contention: slow-down of a stage while all stages compute at once (>= 1; stages share
            the machine's cores: processor sharing, see :mod:`ppstate.sim.simulator`)
            [--contention].
        empty_step_ticks: ticks a stage spends on a step without rows (-1: ``stage_time(0)``,
            the base cost; the runtime skips the forward of such a step) [--empty-step-ticks].
        p2p_ticks: hidden-state hand-off from rank r to r + 1 [--p2p-ticks].
        broadcast_ticks: last rank's sampled-id broadcast until earlier ranks hold it
            [--broadcast-ticks].
        shared_prefix: tokens of one random prefix put in front of every prompt (prefix
            sharing) [--shared-prefix].
        fork_rate: probability a request is a fork of the previous one (same prompt and
            arrival, ``fork_of`` set: the ``n`` samples of one OpenAI request) [--fork-rate];
            0 draws nothing, so runs without forks stay as they were.
        spec_acceptance: with ``scheduler.num_spec_tokens`` = K > 0 [--spec-tokens K] (decode
            rows carry up to K drafts, :mod:`ppstate.sim.spec`), the probability that a draft
            is the model's token [--spec-acceptance]; draws nothing from the seed's generator.
        workload: explicit requests (overrides the random ones; tests).
        max_steps: liveness bound (0: derived from the workload).

    Raises:
        SchedulerError: a field out of range (the message names it).
        TypeError: a keyword that is neither a simulation nor a scheduler field.
    """
    scheduler: SchedulerConfig
    num_requests: int = 16
    seed: int = 0
    prompt_len: tuple[int, int] = (8, 32)
    output_len: tuple[int, int] = (8, 32)
    abort_rate: float = 0.0
    arrival: Literal["burst", "poisson"] = "burst"
    mean_gap: float = 4.0
    eos_prob: float = 0.3
    stage_base: int = 1
    stage_per_token: int = 2
    p2p_ticks: int = 0
    broadcast_ticks: int = 0
    contention: float = 1.0
    empty_step_ticks: int = -1
    shared_prefix: int = 0
    fork_rate: float = 0.0
    spec_acceptance: float = 0.7
    workload: tuple[SimRequest, ...] | None = None
    max_steps: int = 0

    def __init__(self, scheduler: SchedulerConfig | dict | None = None, **fields: Any) -> None:
        flat = {name: fields.pop(name) for name in list(fields) if name in SCHEDULER_FIELDS}
        if isinstance(scheduler, SchedulerConfig):
            if flat:
                if "max_model_len" in flat or "max_num_seqs" in flat or "block_size" in flat:
                    flat.setdefault("num_kv_blocks", None)  # re-derive the default capacity
                scheduler = dataclasses.replace(scheduler, **flat)
        else:
            scheduler = SchedulerConfig(**{**SIM_SCHEDULER_DEFAULTS, **(scheduler or {}), **flat})
        object.__setattr__(self, "scheduler", scheduler)
        for f in dataclasses.fields(self)[1:]:
            object.__setattr__(self, f.name, fields.pop(f.name, f.default))
        if fields:
            raise TypeError(f"SimConfig got unknown fields: {', '.join(sorted(fields))}")
        self.__post_init__()

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise SchedulerError(f"SimConfig.{name} must be 1 <= low <= high, got {lo}:{hi}")
        if self.stage_base < 0 or self.stage_per_token < 0 or \
                self.stage_base + self.stage_per_token == 0:
            raise SchedulerError("SimConfig.stage_base/stage_per_token must be >= 0, not both 0")
        if self.empty_step_ticks < -1:
            raise SchedulerError(f"SimConfig.empty_step_ticks must be >= -1, got {self.empty_step_ticks}")
        if not self.contention >= 1.0:
            raise SchedulerError(f"SimConfig.contention must be >= 1, got {self.contention!r}")
        if self.p2p_ticks < 0 or self.broadcast_ticks < 0:
            raise SchedulerError("SimConfig.p2p_ticks and broadcast_ticks must be >= 0")
        if not 0.0 <= self.abort_rate <= 1.0 or not 0.0 <= self.eos_prob <= 1.0:
            raise SchedulerError("SimConfig.abort_rate and eos_prob must be in [0, 1]")
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise SchedulerError(f"SimConfig.spec_acceptance must be in [0, 1], got "
                                 f"{self.spec_acceptance!r}")
        if not 0.0 <= self.fork_rate <= 1.0:
            raise SchedulerError(f"SimConfig.fork_rate must be in [0, 1], got {self.fork_rate!r}")
        if self.arrival not in ("burst", "poisson"):
            raise SchedulerError(f"SimConfig.arrival must be burst|poisson, got {self.arrival!r}")

    def stage_time(self, num_tokens: int) -> int:
        """Ticks one stage spends on a batch of ``num_tokens`` tokens."""
        return self.stage_base + self.stage_per_token * num_tokens


def make_workload(cfg: SimConfig) -> tuple[SimRequest, ...]:
    """The requests of a run: ``cfg.workload`` if given, else drawn from ``cfg.seed``."""
    if cfg.workload is not None:
        return cfg.workload
    rng = np.random.default_rng(cfg.seed)
    shared = tuple(int(x) for x in rng.integers(FIRST_TOKEN, VOCAB, size=cfg.shared_prefix))
    reqs, t = [], 0
    for i in range(cfg.num_requests):
        plen = int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1))
        max_tokens = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
        prompt = shared + tuple(int(x) for x in rng.integers(FIRST_TOKEN, VOCAB, size=plen))
        eos_at = int(rng.integers(0, max_tokens)) if rng.random() < cfg.eos_prob else -1
        ignore_eos = bool(rng.random() < 0.1)
        if cfg.arrival == "poisson":
            t += int(np.ceil(rng.exponential(cfg.mean_gap)))
        horizon = (plen + max_tokens) * cfg.scheduler.pp_size * cfg.stage_time(4)
        abort_at = t + int(rng.integers(0, horizon + 1)) if rng.random() < cfg.abort_rate else -1
        fork_of = None
        if cfg.fork_rate and reqs and rng.random() < cfg.fork_rate:   # a sample of the previous
            parent = reqs[-1]
            prompt, t, fork_of = parent.prompt, parent.arrival, parent.fork_of or parent.req_id
        reqs.append(SimRequest(f"req-{i}", t, prompt, max_tokens, int(rng.integers(1, 2**31)),
                               eos_at, ignore_eos, abort_at, fork_of))
    return tuple(reqs)
