"""Concurrent one-completion requests answered by one sampler call per batch, behind the doors whose
rollout asks one completion per request (verl's agent loop, OpenRLHF's agent executor).

:class:`RequestBatcher` holds the requests that wait while a batch runs and answers those that
share a key (their sampling parameters) with one call, in a worker thread so the event loop keeps
accepting requests; :func:`sample_requests` is that call: identical prompts become one group of
the sampler's batch (:func:`~.grouping.identical_prompt_groups`), so group-aware paths (the
speculative sampler's shared-prompt decode attention, sibling drafts) see the real groups.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch

from ..errors import GRPOPartsError
from ..sampler.protocol import PromptBatch, Sampler, SamplingParams
from ..types import Rollout
from .grouping import identical_prompt_groups

__all__ = ["Answer", "RequestBatcher", "sample_requests"]

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
#: one request's answer: completion ids, their log-probs, whether it was cut at ``max_new_tokens``
Answer = tuple[list[int], list[float], bool]


def sample_requests(
    sampler: Sampler, prompts: Sequence[Sequence[int]], params: SamplingParams, generator: Any = None
) -> tuple[list[Answer], Rollout]:
    """One ``sampler.generate`` for one-completion requests: each request's :data:`Answer`, in
    request order, and the rollout (its ``stats``)."""
    if any(len(p) == 0 for p in prompts):
        raise GRPOPartsError("prompt_ids: expected at least one token per request, got an empty list")
    unique, g, rows = identical_prompt_groups(prompts)
    batch = PromptBatch.from_lists(unique, params.pad_token_id)
    rollout = sampler.generate(batch, params.model_copy(update={"group_size": g}), generator)
    out: list[Answer] = [([], [], False)] * len(prompts)
    eos = set(params.eos_token_ids)
    for r, i in enumerate(rows):
        n = int(rollout.completion_mask[r].sum())
        ids = rollout.completion_ids[r, :n].tolist()
        truncated = not (ids and ids[-1] in eos) and n >= params.max_new_tokens
        out[i] = (ids, rollout.logprobs[r, :n].to(torch.float64).tolist(), truncated)
    return out, rollout


class RequestBatcher(Generic[K, R]):
    """``await submit(key, prompt)`` from concurrent requests; ``run(key, prompts) -> answers`` (one
    per prompt, in order) answers the waiting requests of one key at a time, up to ``max_batch``,
    once no new request arrived for ``gather_s`` (the requests of one framework batch arrive over a
    few milliseconds; far below a rollout's time). An error goes to every request of its batch."""

    def __init__(
        self,
        run: Callable[[K, list[list[int]]], list[R]],
        gather_s: float = 0.0,
        max_batch: int | None = None,
    ) -> None:
        self.run, self.gather_s, self.max_batch = run, gather_s, max_batch
        self._pending: list[tuple[K, list[int], asyncio.Future]] = []
        self._draining = False

    async def submit(self, key: K, prompt: Sequence[int]) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append((key, list(prompt), fut))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await fut  # type: ignore[no-any-return]

    def _full(self) -> bool:
        return self.max_batch is not None and len(self._pending) >= self.max_batch

    async def _gather(self) -> None:
        await asyncio.sleep(0)  # requests scheduled in the same tick
        n = -1
        while len(self._pending) != n and not self._full():
            n = len(self._pending)
            await asyncio.sleep(self.gather_s)

    async def _drain(self) -> None:
        try:
            while self._pending:
                await self._gather()
                key = self._pending[0][0]
                take = [r for r in self._pending if r[0] == key][: self.max_batch]
                self._pending = [r for r in self._pending if all(r is not t for t in take)]
                try:
                    answers = await asyncio.to_thread(self.run, key, [r[1] for r in take])
                except Exception as e:  # hand the error to every waiting request
                    for r in take:
                        if not r[2].done():
                            r[2].set_exception(e)
                    continue
                for r, a in zip(take, answers):
                    if not r[2].done():  # a cancelled request just drops its answer
                        r[2].set_result(a)
        finally:
            self._draining = False
