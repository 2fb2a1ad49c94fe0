"""How many of the ``pp_size`` in-flight lanes an overlapped scheduler fills with decode rows.

Overlapped mode keeps ``pp_size`` batches in the pipeline; step ``s`` belongs to lane
``s mod pp_size`` and a decoding request runs once per ``pp_size`` steps, always in the same lane.
Spreading R decoding requests over all lanes gives steps of R / pp_size rows that run on all
stages at once. When a step's cost hardly depends on its rows (few rows: the fixed per-step cost
dominates; the CPU path pads GEMMs to 16 rows) or when stages that compute at once slow each other
down (shared cores, caches, memory bandwidth), that doubles the steps without making any cheaper
and overlapped mode ends up slower than sync. With ``adaptive_lanes`` the scheduler fills only the
first L lanes (decode rows wait for a step of an open lane, so the cadence, invariant 5, only gets
longer; a closed lane takes no rows and its numbers are skipped, so one lane issues the steps
sync issues), choosing L = argmin over 1..pp_size of the model's time per decoded token
(:meth:`~ppstate.step_cost.StepCostModel.decode_round_s` / live requests: a lane's batch passes
all ``pp_size`` stages per token, with ``pp_size - L`` lanes of the pipeline left empty), all
lanes on near-ties (:data:`MARGIN`).

Balanced admission (invariant 7) follows the lanes: a step may hold ``ceil(max_num_seqs / L)``
rows (:func:`lane_row_cap`; ``max_rows_per_step`` with all lanes, ``max_num_seqs`` like sync with
one) and ``ceil(max_num_batched_tokens / L)`` tokens (:func:`lane_token_budget`: L batches are in
the pipeline), so one lane can carry every live request when that is the faster schedule. A lane
count is considered only if its share of decode tokens fits that budget. A closed lane takes no
rows at all (no decode row, no prefill chunk, no admission): the scheduler skips its numbers, and
a finished request's freed slot is delivered with the next open lane's step. With one lane the
issued steps are therefore sync mode's steps, on every other number: the stages take turns on
prefill chunks too, which is what the model says is faster when it picks one lane.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppstate.step_cost import model_of

if TYPE_CHECKING:
    from ppstate.budget import SchedulerConfig

#: a smaller lane count must be estimated this much faster than all lanes (hysteresis against
#: flip-flopping on noise in the coefficients)
MARGIN = 0.97


def lane_row_cap(config: "SchedulerConfig", lanes: int) -> int:
    """Rows one step may hold while ``lanes`` (1..pp_size) lanes take decode rows:
    ``ceil(max_num_seqs / lanes)`` overlapped (= ``max_rows_per_step`` with all lanes),
    ``max_num_seqs`` sync."""
    if config.mode == "sync":
        return config.max_num_seqs
    return -(-config.max_num_seqs // max(1, min(lanes, config.pp_size)))


def lane_token_budget(config: "SchedulerConfig", lanes: int) -> int:
    """Tokens one step may schedule while ``lanes`` (1..pp_size) lanes carry work:
    ``config.step_token_budget`` with all lanes (``ceil(max_num_batched_tokens / pp_size)``, at
    least the row cap), ``ceil(max_num_batched_tokens / lanes)`` (at least
    :func:`lane_row_cap`) with fewer, never more than ``max_num_batched_tokens`` (sync's
    budget with one lane)."""
    if config.mode == "sync" or lanes >= config.pp_size:
        return config.step_token_budget
    lanes = max(1, lanes)
    share = -(-config.max_num_batched_tokens // lanes)
    return min(config.max_num_batched_tokens, max(share, lane_row_cap(config, lanes)))


def feasible(config: "SchedulerConfig", live: int, lanes: int) -> bool:
    """True when ``live`` decoding requests fit ``lanes`` lanes: each lane's share of rows within
    :func:`lane_row_cap` and its decode tokens (``1 + num_spec_tokens`` per row) within
    :func:`lane_token_budget`."""
    share = -(-live // lanes)
    return share <= lane_row_cap(config, lanes) and \
        share * (1 + config.num_spec_tokens) <= lane_token_budget(config, lanes)


def choose_lanes(config: "SchedulerConfig", live: int) -> int:
    """Lanes (1..pp_size) to fill for ``live`` live requests (running + waiting, capped at
    max_num_seqs). ``pp_size`` unless overlapped mode with ``config.adaptive_lanes``."""
    pp = config.pp_size
    if config.mode == "sync" or not config.adaptive_lanes or pp == 1 or live <= 0:
        return pp
    model = model_of(config)
    best, best_s = pp, MARGIN * model.decode_round_s(live, pp, pp)
    for lanes in range(pp - 1, 0, -1):
        if not feasible(config, live, lanes):
            break
        est = model.decode_round_s(live, lanes, pp)
        if est < best_s:
            best, best_s = lanes, est
    return best


def lane_open(step: int, lanes: int, pp_size: int) -> bool:
    """True when step ``step`` belongs to one of the first ``lanes`` lanes (decode rows allowed)."""
    return step % pp_size < lanes
