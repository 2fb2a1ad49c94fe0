"""ppstate: the scheduling core of a pipeline-parallel serving runtime, as explicit state machines.

Pure Python + numpy + transitions + pydantic: no asyncio, no torch.distributed, no model code.
"""

from ppstate.batch import FreedSlot, NewRequest, SchedulerOutput, StepResult
from ppstate.errors import (IllegalTransition, MirrorDivergence, PPStateError, SchedulerError,
                            SlotError, TableError)

__all__ = ["FreedSlot", "NewRequest", "SchedulerOutput", "StepResult", "IllegalTransition",
           "MirrorDivergence", "PPStateError", "SchedulerError", "SlotError", "TableError"]
