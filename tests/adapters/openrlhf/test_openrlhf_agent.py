"""Sampler in OpenRLHF: the agent executor returns the dict OpenRLHF's samples generator expects,
serving a whole group with one grpo_parts ``Sampler.generate``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from _openrlhf_helpers import char_tokenizer, tiny_model


def run_group(executor, prompt, n, sampling_params, tokenizer, max_length=24):
    async def main():
        return await asyncio.gather(
            *[
                executor.execute(prompt, "7", sampling_params, max_length, tokenizer, llm_engine=None)
                for _ in range(n)
            ]
        )

    return asyncio.run(main())


@pytest.mark.parametrize("logprobs", [None, 1])
def test_agent_executor_returns_openrlhf_response_dict(logprobs):
    import vllm
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    from grpo_parts.sampler import get_sampler_class

    tok = char_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float32)
    calls = []

    def reward_fn(queries, prompts, labels):
        calls.append((queries, prompts, labels))
        return {
            "rewards": torch.tensor([1.0]),
            "scores": torch.tensor([0.5]),
            "extra_logs": {"len": len(queries[0])},
        }

    # a fixed policy on purpose (no trainer here): allow_frozen (tests/.../test_openrlhf_weight_sync.py)
    ex = GRPOPartsAgentExecutor(
        lambda: get_sampler_class("reference")(model), reward_fn=reward_fn, seed=0, allow_frozen=True
    )
    sp = vllm.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, logprobs=logprobs)
    outs = run_group(ex, "12+3=", 4, sp, tok)

    assert ex.generate_calls == 1  # the group was sampled in one generate call
    prompt_ids = tok(text="12+3=", add_special_tokens=False)["input_ids"]
    expected_keys = {"prompt", "label", "images", "mm_train_inputs", "observation_tokens", "action_ranges",
                     "rollout_log_probs", "truncated", "reward", "scores", "extra_logs"}  # fmt: skip
    for out in outs:
        assert set(out) == expected_keys
        obs, ((start, end),) = out["observation_tokens"], out["action_ranges"]
        assert (
            obs[:start] == prompt_ids
            and start == len(prompt_ids)
            and 1 <= end - start <= 6
            and end == len(obs)
        )
        assert isinstance(out["truncated"], bool) and out["reward"] == 1.0 and out["scores"] == 0.5
        if logprobs is None:
            assert out["rollout_log_probs"] is None
        else:
            assert len(out["rollout_log_probs"]) == len(obs) and all(v <= 0 for v in out["rollout_log_probs"])
    assert len(calls) == 4 and calls[0][1:] == (["12+3="], ["7"])

    # OpenRLHF's own conversion accepts it
    gen = SamplesGenerator.__new__(SamplesGenerator)
    exp = gen._process_response_into_experience(outs[0], max_len=24)
    assert isinstance(exp, Experience) and exp.rewards.tolist() == [1.0]
    ((start, end),) = outs[0]["action_ranges"]
    assert int(exp.action_mask.sum()) == end - start


def test_agent_executor_logprobs_are_the_samplers():
    """Greedy: the executor's completion and log-probs are the sampler's for the same prompt."""
    import vllm
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor

    from grpo_parts.sampler import get_sampler_class
    from grpo_parts.sampler.protocol import PromptBatch, SamplingParams

    tok = char_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float64)
    sampler = get_sampler_class("reference")(model)
    ex = GRPOPartsAgentExecutor(sampler, allow_frozen=True)
    out = run_group(ex, "4+4=", 2, vllm.SamplingParams(temperature=0.0, max_tokens=5, logprobs=1), tok)
    ids = tok(text="4+4=", add_special_tokens=False)["input_ids"]
    direct = sampler.generate(
        PromptBatch.from_lists([ids], 0),
        SamplingParams(temperature=0.0, max_new_tokens=5, eos_token_ids=(1,)),
    )
    n = int(direct.completion_mask[0].sum())
    assert out[0]["observation_tokens"][len(ids) :] == direct.completion_ids[0, :n].tolist()
    torch.testing.assert_close(
        torch.tensor(out[1]["rollout_log_probs"][len(ids) :], dtype=torch.float64), direct.logprobs[0, :n]
    )


def test_agent_executor_with_speculative_sampler_matches_reference_under_greedy():
    """The optimized sampler through the executor: greedy speculative decoding (n-gram draft) emits
    exactly the reference sampler's tokens, with the same log-probs."""
    import vllm
    from grpo_parts_adapters.openrlhf.agent import GRPOPartsAgentExecutor

    from grpo_parts.draft import get_draft_class
    from grpo_parts.sampler import IMPLEMENTATIONS, get_sampler_class

    if "speculative" not in IMPLEMENTATIONS:
        pytest.skip("the 'speculative' Sampler is not registered yet")
    tok = char_tokenizer()
    model = tiny_model("qwen2", dtype=torch.float64)
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    outs = []
    for sampler in (
        get_sampler_class("reference")(model),
        get_sampler_class("speculative")(model, get_draft_class("ngram")()),
    ):
        outs.append(run_group(GRPOPartsAgentExecutor(sampler, allow_frozen=True), "11+11=", 3, sp, tok))
    for ref, spec in zip(*outs):
        assert spec["observation_tokens"] == ref["observation_tokens"]
        torch.testing.assert_close(
            torch.tensor(spec["rollout_log_probs"], dtype=torch.float64),
            torch.tensor(ref["rollout_log_probs"], dtype=torch.float64),
            atol=1e-10,
            rtol=0,
        )
