"""The EAGLE head's direct decoder-layer path (drafting) equals the model-wrapper path."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.decoding.lean_layer import ARCHITECTURES
from grpo_parts.draft.eagle import EagleDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.testing import record_proposals
from grpo_parts.tiny import tiny_causal_lm


def _record(
    draft: EagleDraft, direct: bool, policy: torch.nn.Module, params: SamplingParams
) -> list[torch.Tensor]:
    draft.head.direct = direct
    prompts = PromptBatch.from_lists([[5, 6, 7, 8, 9], [4, 2], [9, 9, 3, 1]], pad_token_id=0)
    sampler = SpeculativeSampler(policy, draft, SpeculativeConfig(draft_tokens=3, train_draft=False))
    return record_proposals(
        draft, lambda: sampler.generate(prompts, params, torch.Generator().manual_seed(0))
    )


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_direct_layer_path_matches_the_model(family: str) -> None:
    policy = tiny_causal_lm(
        family, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, dtype=torch.float64
    )
    draft = EagleDraft(policy)
    draft.head.to(torch.float64)
    assert draft.head.direct and draft.head.lean  # the direct path runs the layer's plain ops
    # greedy: the same tokens are verified either way, so both runs draft from the same contexts;
    # rows accept different counts, so the head's cache has holes and rows feed different numbers
    # of new features
    params = SamplingParams(group_size=2, max_new_tokens=16, temperature=0.0)
    slow = _record(draft, False, policy, params)
    fast = _record(draft, True, policy, params)
    assert len(slow) == len(fast) > 2
    for a, b in zip(slow, fast):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_eager_attention_keeps_the_model_path() -> None:
    policy = tiny_causal_lm("qwen2", vocab_size=16, hidden_size=32, num_layers=1, attn_implementation="eager")
    head = EagleDraft(policy).head
    assert not head.direct and not head.lean
