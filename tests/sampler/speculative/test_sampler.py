"""SpeculativeSampler: greedy identity with the reference sampler, exact log-probs, losslessness
(chi-square against the enumerated policy distribution), and a broken verifier that must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import always_accept

from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.draft.reference import FrozenLMDraft
from grpo_parts.draft.small_lm import CachedLMDraft
from grpo_parts.errors import NotSupportedError
from grpo_parts.sampler.protocol import PromptBatch, Sampler, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.testing import chi_square_gof, encode_sequences, sequence_distribution
from grpo_parts.tiny import tiny_causal_lm
from grpo_parts.types import VisionInputs

V = 8


def _lm(seed: int, layers: int, dtype: torch.dtype, scale: float) -> torch.nn.Module:
    m = tiny_causal_lm("qwen2", vocab_size=V, hidden_size=32, num_layers=layers, seed=seed, dtype=dtype)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)  # peaked enough that drafts are accepted and rejected
    return m


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return _lm(0, 2, torch.float32, 12.0)


def make_draft(name: str, policy: torch.nn.Module) -> object:
    if name == "frozen_lm":
        return FrozenLMDraft(_lm(1, 1, policy.dtype, 12.0))
    if name == "small_lm":
        return CachedLMDraft(_lm(1, 1, policy.dtype, 12.0))
    if name == "ngram":
        return NGramDraft(max_ngram=3)
    return EagleDraft(policy)


DRAFTS = ["frozen_lm", "small_lm", "ngram", "eagle"]
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 1, 2, 5], [3]]


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("k", [3, None])  # None: calibrated cost model chooses k per step
def test_greedy_matches_reference(policy: torch.nn.Module, draft: str, k: int | None) -> None:
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=15, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    cfg = SpeculativeConfig(draft_tokens=k, max_draft_tokens=4, compact_waste=0.2, calibrate_repeats=1)
    spec = SpeculativeSampler(policy, make_draft(draft, policy), cfg)  # type: ignore[arg-type]
    assert isinstance(spec, Sampler)
    for _ in range(2):  # second rollout: history drafts and online updates have state
        out = spec.generate(prompts, params)
        assert torch.equal(out.completion_ids, ref.completion_ids)
        assert torch.equal(out.completion_mask, ref.completion_mask)
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    lengths = ref.completion_lengths()
    assert len(set(lengths.tolist())) > 1, "rows must finish at different steps for this test to bite"
    if k is not None:
        assert out.stats["verify_steps"] > 0


def plain_logprobs(model: torch.nn.Module, rollout, temperature: float) -> torch.Tensor:
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attn = torch.cat([rollout.prompt_mask.long(), rollout.completion_mask.long()], 1)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    p = rollout.prompt_ids.shape[1]
    lg = logits[:, p - 1 : -1] / temperature
    lp = torch.log_softmax(lg, -1).gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    return lp * rollout.completion_mask


@pytest.mark.parametrize("draft", DRAFTS)
def test_logprobs_equal_plain_forward(policy: torch.nn.Module, draft: str) -> None:
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=3, max_new_tokens=12, temperature=0.7, top_p=0.9, eos_token_ids=(3,))
    spec = SpeculativeSampler(policy, make_draft(draft, policy), SpeculativeConfig(draft_tokens=3))  # type: ignore[arg-type]
    out = spec.generate(prompts, params, torch.Generator().manual_seed(0))
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, plain_logprobs(policy, out, 0.7), atol=1e-5, rtol=0)


SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7_p0.9": dict(temperature=0.7, top_p=0.9),
    "topk3": dict(temperature=1.0, top_k=3),
}
PROMPT = [1, 5, 2]
N_SAMPLES = 2000
LENGTH = 4  # token 1 from the prefill, 2-3 drafted and verified, 4 the bonus/correction
_EXACT: dict[str, np.ndarray] = {}


def _sample(policy, draft, setting, verifier=None, shared="off"):
    params = SamplingParams(group_size=N_SAMPLES, max_new_tokens=LENGTH, **SETTINGS[setting])
    kw = {} if verifier is None else {"verifier": verifier}
    cfg = SpeculativeConfig(draft_tokens=2, train_draft=False, decode_shared_prompt=shared)
    spec = SpeculativeSampler(policy, make_draft(draft, policy), cfg, **kw)  # type: ignore[arg-type]
    prompts = PromptBatch.from_lists([PROMPT], pad_token_id=0)
    out = spec.generate(prompts, params, torch.Generator().manual_seed(1234))
    assert out.stats["verify_steps"] > 0
    shared_calls = out.stats["decode_attention_shared_prefix_calls"]
    assert (shared_calls > 0) == (shared == "always"), shared_calls  # the path under test ran (or not)
    return out.completion_ids


def _exact(policy, setting) -> np.ndarray:
    """Exact distribution of the 4-token continuation, ``[V, V, V, V]`` (enumerated once per setting)."""
    if setting not in _EXACT:
        s = SETTINGS[setting]
        probs = sequence_distribution(
            policy, PROMPT, LENGTH, s["temperature"], s.get("top_k", 0), s.get("top_p", 1.0)
        )
        _EXACT[setting] = probs.reshape([V] * LENGTH)
    return _EXACT[setting]


CASES = [(d, "t1") for d in DRAFTS] + [
    ("frozen_lm", "t0.7_p0.9"),
    ("ngram", "t0.7_p0.9"),
    ("eagle", "topk3"),
    ("ngram", "topk3"),
]


# "always": every decode forward reads the group's prompt K/V once (sampler/speculative/decode_attention.py);
# the 2000 rows here are one group, the shape that path is for
SHARED = [("eagle", "t1"), ("ngram", "t0.7_p0.9"), ("frozen_lm", "topk3")]


@pytest.mark.parametrize(
    ("draft", "setting", "shared"), [(*c, "off") for c in CASES] + [(*c, "always") for c in SHARED]
)
def test_lossless_chi_square(policy: torch.nn.Module, draft: str, setting: str, shared: str) -> None:
    comp = _sample(policy, draft, setting, shared=shared)
    exact = _exact(policy, setting)
    # whole 3-token sequences (the prefix of a longer sample is distributed as its marginal)
    assert chi_square_gof(encode_sequences(comp[:, :3], V), exact.sum(-1).reshape(-1)) > 1e-4
    for i in range(LENGTH):  # every position, drafted or not
        marginal = exact.sum(axis=tuple(j for j in range(LENGTH) if j != i))
        assert chi_square_gof(comp[:, i].numpy(), marginal) > 1e-4, f"position {i}"
    pairs = exact.sum(axis=(0, 3)).reshape(-1)  # joint of the two drafted positions
    assert chi_square_gof(encode_sequences(comp[:, 1:3], V), pairs) > 1e-4


@pytest.mark.parametrize(
    ("draft", "setting"), [("frozen_lm", "t1"), ("ngram", "t0.7_p0.9"), ("frozen_lm", "topk3")]
)
def test_broken_verifier_fails(policy: torch.nn.Module, draft: str, setting: str) -> None:
    comp = _sample(policy, draft, setting, verifier=always_accept)
    exact = _exact(policy, setting)
    assert chi_square_gof(encode_sequences(comp[:, :3], V), exact.sum(-1).reshape(-1)) < 1e-6


def test_bad_input_errors(policy: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeConfig(draft_tokens=-1)
    sliding = tiny_causal_lm("mistral", vocab_size=V, hidden_size=32, sliding_window=16)
    spec = SpeculativeSampler(sliding, NGramDraft())
    assert any("sliding" in r for r in spec.not_supported_reasons(SamplingParams()))
    with pytest.raises(ValueError, match="sliding"):  # past the window: refused with the numbers
        spec.generate(PromptBatch.from_lists([[1, 2]], 0), SamplingParams(max_new_tokens=14))


def test_max_new_tokens_exact_and_stats(policy: torch.nn.Module) -> None:
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    for tmax in (1, 2, 7):
        params = SamplingParams(group_size=2, max_new_tokens=tmax, temperature=1.0)
        spec = SpeculativeSampler(policy, NGramDraft(), SpeculativeConfig(draft_tokens=4))
        out = spec.generate(prompts, params, torch.Generator().manual_seed(0))
        assert out.completion_ids.shape[1] == tmax
        assert bool((out.completion_lengths() == tmax).all())
        assert np.isfinite(out.stats["accepted_per_verify"])


def test_plain_and_speculative_steps_interleave(policy: torch.nn.Module) -> None:
    """The cost model may switch speculation off and on within a rollout; a hidden-state draft
    must then catch up on the policy features of the plain steps (greedy output unchanged)."""
    prompts = PromptBatch.from_lists(PROMPTS, pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=15, temperature=0.0, eos_token_ids=(3,))
    ref = ReferenceSampler(policy).generate(prompts, params)
    spec = SpeculativeSampler(
        policy, EagleDraft(policy), SpeculativeConfig(draft_tokens=2, train_draft=False)
    )
    ks = iter([2, 0, 0, 2, 0, 1, 3, 0, 0, 0] + [2] * 50)
    spec.choose_k = lambda active, remaining, step: min(next(ks), remaining - 1)  # type: ignore[method-assign]
    out = spec.generate(prompts, params)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert out.stats["plain_steps"] > 0 and out.stats["verify_steps"] > 0


def test_image_prompts_are_refused_with_the_reason(policy: torch.nn.Module) -> None:
    text = PromptBatch.from_lists([[1, 2]], 0)
    images = PromptBatch(text.input_ids, text.attention_mask, VisionInputs(({},)))
    with pytest.raises(NotSupportedError, match="image prompts are rolled out by the reference sampler only"):
        SpeculativeSampler(policy, NGramDraft()).generate(images, SamplingParams(max_new_tokens=2))
