"""DAPO's zero-variance group filter."""

from __future__ import annotations

import torch
from filter_fakes import scored_batches
from hypothesis import given

from grpo_parts.filter.zero_variance import ZeroVarianceGroups
from grpo_parts.types import ScoredBatch


@given(scored_batches(discrete=True))
def test_zero_variance_keeps_exactly_the_varied_groups(batch: ScoredBatch) -> None:
    res = ZeroVarianceGroups().select(batch, target_size=batch.size)
    r, g = batch.rewards.tolist(), batch.group_index.tolist()
    varied = {gg for gg in set(g) if len({r[i] for i in range(len(r)) if g[i] == gg}) > 1}
    assert res.kept.tolist() == [i for i in range(len(r)) if g[i] in varied]
    assert (res.extra_prompts_wanted > 0) == (res.kept.numel() < batch.size)


def test_zero_variance_all_equal_is_empty() -> None:
    b = ScoredBatch(torch.zeros(6), torch.zeros(6), torch.tensor([0, 0, 1, 1, 2, 2]))
    res = ZeroVarianceGroups().select(b, target_size=6)
    assert res.is_empty and res.extra_prompts_wanted == 3 and res.info["dropped_groups"] == 3
