"""Models the speculative sampler serves: recurrent/hybrid caches refused at construction with a
reason; sliding-window models served exactly inside the window (greedy identity with the reference
sampler, through cache compaction) and refused with the numbers past it."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.draft.ngram import NGramDraft
from grpo_parts.errors import NotSupportedError
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.reference import ReferenceSampler
from grpo_parts.sampler.speculative.model_support import layer_kinds, recurrent_reasons, sliding_window
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.tiny import tiny_causal_lm


def test_hybrid_conv_model_refused_at_construction() -> None:
    lfm2 = tiny_causal_lm("lfm2", vocab_size=16, hidden_size=32)
    with pytest.raises(NotSupportedError, match=r"lfm2 has recurrent/convolutional layers \(conv\)"):
        SpeculativeSampler(lfm2, NGramDraft())


def test_mamba_and_nemotron_h_configs_refused() -> None:
    import transformers

    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=1, state_size=4)
    )
    with pytest.raises(NotSupportedError, match="mamba has recurrent"):
        SpeculativeSampler(mamba, NGramDraft())

    class NemotronHLike(torch.nn.Module):  # config only: the check reads nothing else
        config = type("Cfg", (), {"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-"})()

    assert layer_kinds(NemotronHLike.config) == ["mamba", "mlp", "attention"]
    assert "nemotron_h has recurrent/convolutional layers (mamba)" in recurrent_reasons(NemotronHLike())[0]
    assert recurrent_reasons(tiny_causal_lm("qwen2", vocab_size=16)) == []


@pytest.mark.parametrize("family", ["mistral", "gpt_oss", "gemma2"])
def test_sliding_window_served_exactly_inside_the_window(family: str) -> None:
    policy = tiny_causal_lm(family, vocab_size=12, hidden_size=32, sliding_window=16, seed=3)
    with torch.no_grad():
        policy.lm_head.weight.mul_(10.0)
    assert sliding_window(policy) == 16
    prompts = PromptBatch.from_lists([[1, 2, 3], [4, 5]], pad_token_id=0)
    params = SamplingParams(group_size=2, max_new_tokens=12, temperature=0.0)  # 3 + 12 = 15 = W - 1
    ref = ReferenceSampler(policy).generate(prompts, params)
    for draft in (NGramDraft(max_ngram=2), EagleDraft(policy)):
        cfg = SpeculativeConfig(draft_tokens=3, train_draft=False, compact_waste=0.9)
        spec = SpeculativeSampler(policy, draft, cfg)  # type: ignore[arg-type]
        assert spec.not_supported_reasons(params) == []
        out = spec.generate(prompts, params)
        assert out.stats["verify_steps"] > 0
        assert torch.equal(out.completion_ids, ref.completion_ids), draft.name
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    long = SamplingParams(group_size=2, max_new_tokens=13)
    with pytest.raises(NotSupportedError, match="prompt width 3 \\+ max_new_tokens 13 = 16 exceeds the 15"):
        spec.generate(prompts, long)


def test_qwen2_window_unused_is_not_a_window() -> None:
    policy = tiny_causal_lm("qwen2", vocab_size=12, sliding_window=8, use_sliding_window=False)
    assert sliding_window(policy) is None
