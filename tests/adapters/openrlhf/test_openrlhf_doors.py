"""Door parity, OpenRLHF (issue 38, docs/doors.md): the ``GRPOPartsAgentExecutor`` (OpenRLHF calls
``execute`` once per completion, concurrently) on a speculative sampler runs the decode
optimizations of the table on a tiny Llama policy, and each count reaches OpenRLHF's logs: the
executor puts the rollout's stats in ``extra_logs`` (``parts/sampler/<key>``), which OpenRLHF's own
``_process_response_into_experience`` copies into ``Experience.info``.

The training-side rows run behind OpenRLHF's own seams and are pinned where those seams are tested:
the padding-free layout in tests/adapters/openrlhf/test_openrlhf_actor.py
(``parts/attention/calls_varlen_cascade``), CPPO and refill in
tests/adapters/openrlhf/test_openrlhf_refill.py and test_openrlhf_filter_ranks.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from door_fixtures import (
    COMPLETION_TOKENS,
    REFUSAL_COUNTERS,
    SAMPLER_COUNTERS,
    missing,
    reasoning_problems,
    sampler_kwargs,
    tiny_reasoner,
)

G = 4  # n_samples_per_prompt


def _experiences(draft: str, trees: bool) -> list[Any]:
    """4 prompts x ``G`` completions through the executor, converted by OpenRLHF."""
    import vllm
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from grpo_parts.build import build_draft, build_sampler

    model, tok = tiny_reasoner()
    sampler = build_sampler(
        "speculative", model, draft=build_draft(draft, model), kwargs=sampler_kwargs(trees)
    )
    ex = GRPOPartsAgentExecutor(sampler, seed=0, allow_frozen=True)  # a fixed policy: no trainer here
    sp = vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=COMPLETION_TOKENS, logprobs=1)
    prompts, answers = reasoning_problems(4)

    async def main() -> list[Any]:
        return await asyncio.gather(
            *[
                ex.execute(p, a, sp, 256, tok, llm_engine=None)
                for p, a in zip(prompts, answers)
                for _ in range(G)
            ]
        )

    outs = asyncio.run(main())
    assert ex.generate_calls == 1  # every prompt's G calls in one generate, one group each
    gen = SamplesGenerator.__new__(SamplesGenerator)
    return [gen._process_response_into_experience(o, max_len=256) for o in outs]


@pytest.mark.parametrize(("draft", "trees"), [("ngram", False), ("eagle", True)])
def test_the_executor_runs_the_decode_optimizations(draft: str, trees: bool) -> None:
    exps = _experiences(draft, trees)
    info = {k: float(v) for k, v in exps[0].info.items()}  # every sample carries its rollout's stats
    wanted = {k: v for k, v in SAMPLER_COUNTERS.items() if k != "draft trees" or trees}
    if draft != "eagle":
        wanted.pop("online draft training")
    assert missing(info, wanted, prefix="parts/sampler/") == {}, info
    assert all(info["parts/sampler/" + k] == 0 for k in REFUSAL_COUNTERS), info
    assert info["parts/sampler/model_forward_calls"] == 0
