"""Concurrent one-completion requests answered in batches (``grpo_parts.doors.serving``); the
samplers behind it run in tests/adapters/verl/test_agent_loop.py and test_openrlhf_agent.py."""

from __future__ import annotations

import asyncio

import pytest

from grpo_parts.doors.serving import RequestBatcher


def test_requests_of_one_key_share_one_call_and_errors_reach_every_request() -> None:
    calls: list[tuple[str, list[list[int]]]] = []

    def run(key: str, prompts: list[list[int]]) -> list[int]:
        calls.append((key, prompts))
        if key == "bad":
            raise ValueError("boom")
        return [sum(p) for p in prompts]

    async def main() -> list[object]:
        batcher: RequestBatcher[str, int] = RequestBatcher(run, max_batch=8)
        jobs = [batcher.submit("a", [1, 2]), batcher.submit("b", [3]), batcher.submit("a", [4]),
                batcher.submit("bad", [5])]  # fmt: skip
        return await asyncio.gather(*jobs, return_exceptions=True)

    got = asyncio.run(main())
    assert got[:3] == [3, 3, 4] and isinstance(got[3], ValueError)
    assert sorted(calls) == [("a", [[1, 2], [4]]), ("b", [[3]]), ("bad", [[5]])]


def test_max_batch_splits_a_key() -> None:
    sizes: list[int] = []

    def run(key: str, prompts: list[list[int]]) -> list[int]:
        sizes.append(len(prompts))
        return [0] * len(prompts)

    async def main() -> None:
        batcher: RequestBatcher[str, int] = RequestBatcher(run, max_batch=2)
        await asyncio.gather(*(batcher.submit("k", [i]) for i in range(5)))

    asyncio.run(main())
    assert sum(sizes) == 5 and max(sizes) <= 2


def test_an_empty_prompt_is_refused() -> None:
    from grpo_parts.doors.serving import sample_requests
    from grpo_parts.errors import GRPOPartsError
    from grpo_parts.sampler.protocol import SamplingParams

    with pytest.raises(GRPOPartsError, match="at least one token"):
        sample_requests(None, [[]], SamplingParams(group_size=1, max_new_tokens=1, pad_token_id=0))  # type: ignore[arg-type]
