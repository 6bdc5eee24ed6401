"""PODS max-variance down-sampling."""

from __future__ import annotations

import itertools

import pytest
import torch
from filter_fakes import scored_batches
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from grpo_parts.filter._common import zero_variance_rows
from grpo_parts.filter.pods import MaxVarianceDownsample, max_variance_subset
from grpo_parts.types import ScoredBatch


@given(
    st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(-2, 2), min_size=1, max_size=8),
    st.integers(1, 8),
)
def test_max_variance_subset_matches_brute_force(rewards: list[float], m: int) -> None:
    r = torch.tensor(rewards, dtype=torch.float64)
    pick = max_variance_subset(r, m)
    assert pick.tolist() == sorted(pick.tolist()) and pick.numel() == min(m, len(rewards))
    best = max(
        float(r[list(c)].var(unbiased=False))
        for c in itertools.combinations(range(len(rewards)), min(m, len(rewards)))
    )
    assert float(r[pick].var(unbiased=False)) == pytest.approx(best, rel=1e-12, abs=1e-12)


@given(scored_batches(), st.integers(1, 8), st.booleans())
def test_pods_keeps_m_per_varied_group(batch: ScoredBatch, m: int, drop: bool) -> None:
    kept = MaxVarianceDownsample(m=m, drop_zero_variance=drop).select(batch).kept
    zv = zero_variance_rows(batch)
    for g in torch.unique(batch.group_index).tolist():
        rows = (batch.group_index == g).nonzero().flatten()
        n_kept = int(torch.isin(kept, rows).sum())
        expect = 0 if (drop and bool(zv[rows[0]])) else min(m, rows.numel())
        assert n_kept == expect


def test_pods_pruning_rate_and_validation() -> None:
    r = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0, 0.4, 0.6, 0.2], dtype=torch.float64)
    b = ScoredBatch(r, r - r.mean(), torch.zeros(8, dtype=torch.long))
    assert MaxVarianceDownsample(pruning_rate=0.75).select(b).kept.tolist() == [0, 4]
    assert MaxVarianceDownsample(m=4).select(b).kept.tolist() == [0, 1, 3, 4]
    with pytest.raises(ValidationError, match="m / pruning_rate"):
        MaxVarianceDownsample()
    with pytest.raises(ValidationError, match="m"):
        MaxVarianceDownsample(m=0)
