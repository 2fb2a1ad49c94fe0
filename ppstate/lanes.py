"""How many of the ``pp_size`` in-flight lanes an overlapped scheduler fills with decode rows.

Overlapped mode keeps ``pp_size`` batches in the pipeline; step ``s`` belongs to lane
``s mod pp_size`` and a decoding request runs once per ``pp_size`` steps, always in the same lane.
Spreading R decoding requests over all lanes gives steps of R / pp_size rows that run on all
stages at once; when a step's cost hardly depends on its rows (few rows: the fixed per-step cost
dominates) this doubles the steps without making any cheaper, and stages that share cores slow
each other down, so overlapped mode ends up slower than sync. With ``adaptive_lanes`` the
scheduler fills only the first L lanes (decode rows wait for a step of an open lane), choosing L
from the calibrated :class:`~ppstate.step_cost.StepCostModel`: the L with the shortest decode
round (:meth:`~ppstate.step_cost.StepCostModel.decode_round_s`), all lanes on ties. Only L whose
row share ``ceil(live / L)`` stays within the balanced-admission cap ``max_rows_per_step`` are
considered (invariant 7 is unchanged); the decode cadence (invariant 5) only gets longer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppstate.step_cost import model_of

if TYPE_CHECKING:
    from ppstate.budget import SchedulerConfig

#: a smaller lane count must be estimated this much faster than all lanes (hysteresis against
#: flip-flopping on noise in the coefficients)
MARGIN = 0.97


def choose_lanes(config: "SchedulerConfig", live: int) -> int:
    """Lanes (1..pp_size) to fill for ``live`` live requests (running + waiting, capped at
    max_num_seqs). ``pp_size`` unless overlapped mode with ``config.adaptive_lanes``."""
    pp = config.pp_size
    if config.mode == "sync" or not config.adaptive_lanes or pp == 1 or live <= 0:
        return pp
    model = model_of(config)
    best, best_s = pp, MARGIN * model.decode_round_s(live, pp, pp)
    for lanes in range(pp - 1, 0, -1):
        if -(-live // lanes) > config.max_rows_per_step:
            break
        est = model.decode_round_s(live, lanes, pp)
        if est < best_s:
            best, best_s = lanes, est
    return best


def lane_open(step: int, lanes: int, pp_size: int) -> bool:
    """True when step ``step`` belongs to one of the first ``lanes`` lanes (decode rows allowed)."""
    return step % pp_size < lanes
