"""A PP pipeline in one process: the real Scheduler, StageRunners, DeviceStates and StageModels,
wired by an in-memory stand-in for the process groups, driven tick by tick.

Why: the multi-process engine runs the worker code in child processes, where neither a test nor a
mutation tool can see which step ran what. Here every step is a function call, so a test can act
at an exact step (abort while a deferred PPHandler entry is in flight) and count steps instead of
seconds, and ``make mutants`` can map runner / device-state mutants to the tests that cover them.

Timing model (the same as the simulator's): in tick ``t`` rank ``r`` runs the step rank ``r - 1``
ran in tick ``t - 1``; ranks run last to first inside a tick. A non-last rank whose step consumes
a deferred receive of a step the last rank has not run yet waits for a later tick, as a real rank
blocks in the consume (the scheduler skips numbers of steps that would carry nothing, so the
step consumed may have been issued only one tick before). A non-last rank that waits on a
broadcast the last rank never posted raises (the deadlock a multi-process run would hit), so a
wrong broadcast decision fails loudly here too.
"""

from __future__ import annotations

from collections import deque

import torch

from ppstate.batch import SchedulerOutput
from ppstate.request import TokenUpdate
from ppstate.scheduler import RequestSpec, Scheduler, SchedulerConfig
from runtime.sampling_params import SamplingParams
from runtime.worker.device_state import DeviceState
from runtime.worker.runner import StageRunner


class _Wire:
    """Hidden-state queues between neighbouring ranks and the last rank's broadcasts, in order."""

    def __init__(self, pp_size: int) -> None:
        self.p2p = [deque() for _ in range(pp_size)]  # p2p[r]: tensors sent to rank r
        self.published: list[torch.Tensor] = []       # broadcasts of the last rank, posting order


class _Work:
    """Completion handle of a non-last rank's k-th posted broadcast receive."""

    def __init__(self, wire: _Wire, k: int, buf: torch.Tensor) -> None:
        self.wire, self.k, self.buf = wire, k, buf

    def wait(self, *_timeout) -> None:
        if self.k >= len(self.wire.published):
            raise RuntimeError(f"broadcast #{self.k} was never posted by the last rank "
                               "(a multi-process run would deadlock here)")
        self.buf.copy_(self.wire.published[self.k])


class LocalGroups:
    """In-process stand-in for :class:`runtime.worker.groups.PPGroups` (overlapped mode only)."""

    def __init__(self, rank: int, pp_size: int, wire: _Wire,
                 device: torch.device = torch.device("cpu")) -> None:
        self.rank, self.pp_size, self.wire = rank, pp_size, wire
        self.device = device
        self.num_posted = 0

    is_first = property(lambda self: self.rank == 0)
    is_last = property(lambda self: self.rank == self.pp_size - 1)
    last_rank = property(lambda self: self.pp_size - 1)

    def comm_device(self) -> torch.device:
        return self.device

    def send_next(self, tensor: torch.Tensor) -> None:
        self.wire.p2p[self.rank + 1].append(tensor.clone())

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        got = self.wire.p2p[self.rank].popleft()
        assert tuple(got.shape) == tuple(shape) and got.dtype == dtype, (got.shape, shape)
        return got

    def post_broadcast(self, buf: torch.Tensor):
        k, self.num_posted = self.num_posted, self.num_posted + 1
        if self.is_last:
            self.wire.published.append(buf.clone())
            return None, buf
        return _Work(self.wire, k, buf), buf

    def keep_pending(self, work, tensor: torch.Tensor) -> None:
        """Nothing to keep alive: the last rank's payload was copied when posted."""

    def wait(self, work) -> None:
        work.wait()


class InprocPipeline:
    """``pp_size`` ranks over ``stages`` (one :class:`StageModel` per rank) and one Scheduler.

    Args:
        stages: ``[pp_size]`` StageModels built with ``max_num_reqs >= max_num_seqs``.
        max_num_seqs, max_model_len, max_prefill_chunk, max_num_batched_tokens: scheduler limits.
        eos_token_id: EOS id handed to every request (SmolLM2: 2).
        num_spec_tokens, spec_ngram: n-gram speculative decoding (``--spec-tokens``,
            ``--spec-ngram``); 0 drafts: off.
        mode: ``overlapped`` or ``sync`` (one step in flight; the ranks' PPHandlers have depth 1,
            so rank 0 consumes step s's broadcast at step s + 1, which the scheduler issues only
            after step s's result, i.e. after the last rank posted it).
        device: where the ranks' state lives (``stages`` built on it); CUDA ranks check their
            mirrors asynchronously, as in the engine.
    """

    def __init__(self, stages, max_num_seqs: int, max_model_len: int = 256,
                 max_prefill_chunk: int = 32, max_num_batched_tokens: int = 256,
                 eos_token_id: int = 2, num_spec_tokens: int = 0, spec_ngram: int = 3,
                 mode: str = "overlapped", device: str = "cpu",
                 check_kernel: str = "graph") -> None:
        self.pp = len(stages)
        self.sched = Scheduler(SchedulerConfig(
            pp_size=self.pp, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_chunk=max_prefill_chunk, max_model_len=max_model_len, mode=mode,
            num_spec_tokens=num_spec_tokens))
        wire = _Wire(self.pp)

        def spec(r: int):
            if num_spec_tokens == 0:
                return None
            from runtime.sampling.speculative_verify import SpecDecoder
            return SpecDecoder(num_spec_tokens, spec_ngram, r == 0, r == self.pp - 1)
        self.runners = [
            StageRunner(LocalGroups(r, self.pp, wire, torch.device(device)), st,
                        DeviceState(max_num_seqs, max_model_len, 1 + num_spec_tokens,
                                    torch.device(device), r),
                        overlapped=mode == "overlapped", validate_every=1, spec=spec(r),
                        check_kernel=check_kernel)
            for r, st in enumerate(stages)]
        self.queues: list[deque[SchedulerOutput]] = [deque() for _ in range(self.pp)]
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.steps: list[SchedulerOutput] = []     # every issued step, in order
        self.ticks = 0
        self.last_result_step = -1                  # newest step that left the last rank
        self.eos = frozenset({eos_token_id})

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Queue a request (it is admitted by a later :meth:`tick`)."""
        self.sched.add_request(RequestSpec(
            req_id=req_id, prompt_token_ids=tuple(prompt), max_tokens=params.max_tokens,
            eos_token_ids=self.eos, stop_token_ids=frozenset(params.stop_token_ids),
            ignore_eos=params.ignore_eos, sampling=params.model_dump()))
        self.tokens[req_id] = []

    def abort(self, req_id: str) -> bool:
        """Abort like the engine does: the scheduler frees the slot in its next output."""
        self.finish.setdefault(req_id, "abort")
        return self.sched.abort(req_id)

    def tick(self) -> list[TokenUpdate]:
        """Issue at most one step, advance every rank by at most one step; the updates of the
        step that left the last rank in this tick (possibly none)."""
        out = self.sched.schedule()
        if out is not None:
            self.steps.append(out)
            self.queues[0].append(out)
        updates: list[TokenUpdate] = []
        for r in reversed(range(self.pp)):
            if not self.queues[r] or not self._deferred_posted(r, self.queues[r][0]):
                continue
            o = self.queues[r].popleft()
            result = self.runners[r].step(o)
            if r + 1 < self.pp:
                self.queues[r + 1].append(o)
            else:
                updates = self.sched.on_step_result(result)
                self.last_result_step = o.step
        for u in updates:
            if u.req_id in self.tokens and u.req_id not in self.finish:
                self.tokens[u.req_id] += list(u.token_ids)
                if u.finish_reason is not None:
                    self.finish[u.req_id] = u.finish_reason
        self.ticks += 1
        return updates

    def _deferred_posted(self, rank: int, out: SchedulerOutput) -> bool:
        """The last rank ran every step whose deferred receive rank ``rank`` consumes in ``out``
        (entries of steps ``<= out.step - depth``, skipped numbers' turns included)."""
        h = self.runners[rank].handler
        return h is None or all(p <= self.last_result_step for p in h.pending_steps()
                                if p <= out.step - h.depth)

    @property
    def idle(self) -> bool:
        return not self.sched.has_unfinished() and not any(self.queues)

    def run_until(self, cond, max_ticks: int) -> int:
        """Tick until ``cond(self)`` holds; returns the ticks taken.

        Raises:
            AssertionError: ``cond`` still false after ``max_ticks`` ticks.
        """
        for n in range(max_ticks):
            if cond(self):
                return n
            self.tick()
        assert cond(self), f"condition not met within {max_ticks} ticks"
        return max_ticks

    def handler(self, rank: int = 0):
        """The PPHandler of a non-last rank."""
        return self.runners[rank].handler
