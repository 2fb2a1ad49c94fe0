"""Project errors. Every error names the thing it is about (request, slot, step, field)."""

from __future__ import annotations


class PPStateError(Exception):
    """Base class of all ppstate errors."""


class TableError(PPStateError):
    """A specs/*.yaml file is malformed. The message names the file, the key path and the line."""


class IllegalTransition(PPStateError):
    """A lifecycle trigger was fired from a state that has no such edge (or whose guard failed)."""

    def __init__(self, req_id: str, state: str, trigger: str, reason: str = "no such edge") -> None:
        self.req_id, self.state, self.trigger = req_id, state, trigger
        super().__init__(
            f"request {req_id!r} in state {state!r} cannot take trigger {trigger!r}: {reason}")


class SlotError(PPStateError):
    """Slot table misuse: no free slot, double free, unknown request, request already placed."""


class MirrorDivergence(PPStateError):
    """A CPU mirror differs from the device value for a live slot (invariant 4).

    Attributes name where: ``rank``, ``step``, ``slot``, ``req_id``, ``field``, ``cpu``, ``device``.
    """

    def __init__(self, *, step: int, slot: int, req_id: str | None, field: str,
                 cpu: int, device: int, rank: int | None = None) -> None:
        self.step, self.slot, self.req_id, self.field = step, slot, req_id, field
        self.cpu, self.device, self.rank = cpu, device, rank
        where = f"rank {rank} " if rank is not None else ""
        super().__init__(
            f"{where}step {step}: mirror {field} of slot {slot} (request {req_id!r}) is {cpu} "
            f"on the CPU but {device} on the device")


class SchedulerError(PPStateError):
    """Invalid request or scheduler call (e.g. prompt longer than max_model_len, unknown req_id)."""


class BlockError(PPStateError):
    """Illegal use of the KV block pool (not enough blocks, double free, illegal block transition)."""
