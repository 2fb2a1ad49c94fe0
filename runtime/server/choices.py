"""Several generations behind one HTTP request: ``n`` / ``best_of`` samples of each prompt of a batch.

Choice ``k`` of a request with P prompts and S samples per prompt (S = ``best_of`` or ``n``) is
sample ``k % S`` of prompt ``k // S``. The first sample of a prompt is submitted first; the others
are forks of it (``fork_of``): the scheduler admits them once its prefill is scheduled, and they
share its full prompt KV blocks through the prefix cache instead of recomputing them. A seeded
request gives sample ``j`` the seed ``seed + j`` (mod 2**63), so ``seed`` + ``n`` reproduces, and
sample ``j`` equals a single request with that seed.

Every exit (client gone, error, normal end) closes every generation, which aborts the unfinished
ones in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import anyio
from starlette.types import Receive

from runtime.engine.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.server.errors import APIError
from runtime.server.generation import Collected, Generation

SEED_MOD = 2**63


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of sample ``j`` of a prompt: the seed shifted by ``j`` when seeded."""
    if j == 0 or params.seed is None:
        return params
    return params.model_copy(update={"seed": (params.seed + j) % SEED_MOD})


class Choices:
    """The generations of one request, in choice order.

    Args:
        gens: ``[P * S]`` generations; ``gens[p * S]`` is prompt p's first sample, the others
            of that prompt are its forks.
        samples: S, samples per prompt.
    """

    def __init__(self, gens: Sequence[Generation], samples: int) -> None:
        self.gens, self.samples = list(gens), samples

    def start(self) -> None:
        """Submit every generation (the first sample of each prompt before its forks).

        Raises:
            APIError: as :meth:`Generation.start`; generations already submitted are left
                to :meth:`close`, which the caller runs.
        """
        for g in self.gens:
            g.start()

    async def close(self) -> None:
        """Close every generation (aborts the unfinished ones); idempotent."""
        for g in self.gens:
            await g.close()

    async def collect(self, receive: Receive) -> list[Collected] | None:
        """Run every generation to its end; None (all aborted) if the client disconnected.

        Raises:
            APIError: the first generation's failure (the others are aborted).
        """
        results: list[Collected | None] = [None] * len(self.gens)
        failed: list[APIError] = []

        async def run(k: int, cancel: anyio.CancelScope) -> None:
            try:
                results[k] = await self.gens[k].collect()
            except APIError as exc:
                failed.append(exc)
                cancel.cancel()

        async def watch(cancel: anyio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cancel.cancel()

        try:
            async with anyio.create_task_group() as tg:
                async with anyio.create_task_group() as runners:
                    for k in range(len(self.gens)):
                        runners.start_soon(run, k, tg.cancel_scope)
                    tg.start_soon(watch, tg.cancel_scope)
                tg.cancel_scope.cancel()   # every generation ended: stop watching
        finally:
            await self.close()
        if failed:
            raise failed[0]
        if any(r is None for r in results):
            return None
        return results  # type: ignore[return-value]

    async def interleaved(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(choice, increment)`` pairs of every generation in the order they arrive.

        Raises:
            APIError: the first generation's failure (the others are closed).
        """
        if len(self.gens) == 1:
            async for out in self.gens[0].outputs():
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(k: int, g: Generation) -> None:
            try:
                async for out in g.outputs():
                    queue.put_nowait((k, out, None))
            except APIError as exc:
                queue.put_nowait((k, None, exc))
            finally:
                queue.put_nowait((k, None, None))

        tasks = [asyncio.create_task(pump(k, g)) for k, g in enumerate(self.gens)]
        live = len(tasks)
        try:
            while live:
                k, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                if out is None:
                    live -= 1
                    continue
                yield k, out
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()


def best_choices(results: Sequence[Collected], prompts: int, best_of: int, n: int) -> list[Collected]:
    """The ``n`` samples of each prompt with the highest cumulative logprob, best first
    (``results``: ``[prompts * best_of]`` in choice order; stable for ties)."""
    out: list[Collected] = []
    for p in range(prompts):
        group = list(results[p * best_of:(p + 1) * best_of])
        group.sort(key=lambda r: -r.cumulative_logprob)
        out.extend(group[:n])
    return out
