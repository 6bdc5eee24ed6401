"""The KV-cached small-LM draft proposes exactly what the re-encoding reference draft proposes."""

from __future__ import annotations

import pytest
import torch

from grpo_parts.draft.reference import FrozenLMDraft
from grpo_parts.draft.small_lm import CachedLMDraft
from grpo_parts.sampler.protocol import PromptBatch, SamplingParams
from grpo_parts.sampler.speculative.sampler import SpeculativeConfig, SpeculativeSampler
from grpo_parts.testing import record_proposals
from grpo_parts.tiny import tiny_causal_lm


def _proposals(draft: FrozenLMDraft, policy: torch.nn.Module, k: int | None) -> list[torch.Tensor]:
    prompts = PromptBatch.from_lists([[5, 6, 7, 8, 9], [4, 2], [9, 9, 3, 1]], pad_token_id=0)
    # greedy: both drafts see the same verified tokens, so their contexts are the same; rows accept
    # different counts (holes) and one row stops at EOS 3 early (rows leave the cache)
    params = SamplingParams(group_size=2, max_new_tokens=16, temperature=0.0, eos_token_ids=(3,))
    cfg = SpeculativeConfig(draft_tokens=k, max_draft_tokens=4, train_draft=False, calibrate_repeats=1)
    sampler = SpeculativeSampler(policy, draft, cfg)
    return record_proposals(
        draft, lambda: sampler.generate(prompts, params, torch.Generator().manual_seed(0))
    )


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("k", [1, 3])
def test_cached_draft_matches_the_reference_draft(family: str, k: int) -> None:
    policy = tiny_causal_lm(
        family, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, dtype=torch.float64
    )
    small = tiny_causal_lm(
        family, vocab_size=16, hidden_size=16, num_layers=1, num_heads=2, seed=3, dtype=torch.float64
    )
    want = _proposals(FrozenLMDraft(small), policy, k)
    got = _proposals(CachedLMDraft(small), policy, k)
    assert len(want) == len(got) > 2
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
